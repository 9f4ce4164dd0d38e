"""Chat templates in a bounded sandbox: a checkpoint's jinja template, which a malicious export may write, renders
a conversation as transformers' `apply_chat_template` does, but never reaches past the values it is given (jinja's
immutable sandbox), and every step is bounded before it runs: the lines a render runs, the wall clock (read at
template lines and at every Python call the render makes), the size of every value a filter, method or global
makes and of the output, the bits of an integer. What a limit stops is a RefusionError naming it.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import json
import re
import string
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from datetime import datetime
from functools import lru_cache
from types import FrameType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from refusion.runtime.core.errors import RefusionError

# Older names for a message's reasoning; transformers copies them to `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, as transformers does, so the sandbox only sees safe objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, ...) carry methods the sandbox doesn't know
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    np = sys.modules.get("numpy")  # a numpy scalar can only exist if numpy is already imported
    if np is not None and isinstance(value, np.generic):
        return plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic, e.g. OpenAI SDK messages
        return plain(value.model_dump())
    return f"<{type(value).__name__}>"


def alias_reasoning(message: dict) -> dict:
    # transformers fills `reasoning_content` (and `thinking`, for gpt-oss) from whichever name the caller used.
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


# --- jinja environment, as transformers builds it -------------------------------------------


def _raise_exception(message: str) -> None:
    raise RefusionError(f"the chat template refused the conversation: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    # Unlike jinja's built-in tojson: no HTML escaping, and the json.dumps options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    _check_size("a date", 32 * len(format))  # %c: 24 characters for 2
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself; within the size limit."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        args = tuple(_materialized(a) for a in args)
        _check_size("a dict", _OBJECT_BYTES * (sum(_count(a) for a in args) + len(kwargs)))
        return dict(*args, **kwargs)

    def fromkeys(self, iterable: Iterable[Any], value: Any = None) -> dict:
        keys = _listed(iterable)
        _check_size("a dict", _OBJECT_BYTES * len(keys))
        return dict.fromkeys(keys, value)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace, refusing underscore attributes so templates cannot reach CPython internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


class _GenerationTag(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` marks assistant text; here it renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    # Templates come from downloaded checkpoints: older jinja2 has known sandbox escapes.
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise RefusionError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes; run `pip install -U 'jinja2>=3.1.6'`"
        )
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols],
                          finalize=_bounded_output)
    env.concat = _bounded_join(env.concat)  # type: ignore[method-assign]  # a block's, a macro's text
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items() if name in _FILTERS}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["lipsum"] = _bounded_lipsum
    try:
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise RefusionError(
            f"the checkpoint's chat template is not valid Jinja (line {e.lineno}: {e.message}); "
            "fix chat_template.jinja / tokenizer_config.json, or pass raw text or token ids instead"
        ) from e
    # `a ~ b` compiles to a call of the module's str_join / markup_join, which no sandbox hook sees.
    namespace = template.root_render_func.__globals__
    for name in ("str_join", "markup_join"):
        namespace[name] = _bounded_join(namespace[name])
    return template


# --- bounds on what a template may do: the sandbox stops escapes, these stop a template that hangs or fills memory
# ('a' * 10**8, range(100000) nested twice, (['a' * 60000000] * 100) | join, lipsum(300000)). Every operator,
# filter, method and global a template can reach is checked before it runs: the size of what it will make is
# estimated from its arguments (a filter or a built-in method not listed here is refused), so that no single step
# allocates much or runs long; a trace counts the template's lines and, at each of them and each Python call the
# render makes (in jinja's filters and globals too), stops it at the time limit. A real chat template stays far
# below these limits.
TEMPLATE_MAX_LINES = 2_000_000  # template code lines run per render (loops, macros)
TEMPLATE_MAX_SECONDS = 10.0  # wall clock per render, read every _CLOCK_EVERY template lines and Python calls
TEMPLATE_MAX_SIZE = 64 << 20  # bytes of any value one step makes (a string's characters, 8 a list's item) or output
TEMPLATE_MAX_INT_BITS = 1 << 16  # an integer a template computes: a product of larger ones takes seconds in C
_CLOCK_EVERY = 1000
_ITEM_BYTES = 8  # a container's reference to an item
_OBJECT_BYTES = 64  # a new small object: a split's piece, one of list(text)'s characters, a group, a pair
_ESCAPED = 12  # the most characters repr() or JSON writes for one character (\ud83d\ude00)
_LIPSUM_WORD_BYTES = 16  # the longest lorem ipsum word and its separator, and the paragraph's markup
_LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines cuts


def _over_limit(what: str) -> RefusionError:
    return RefusionError(f"the chat template {what}; it loops without end or is hostile: fix chat_template.jinja")


def _too_big(what: str, size: int) -> RefusionError:
    return _over_limit(f"made {what} of {size}, over its limit of {TEMPLATE_MAX_SIZE}")


def _check_size(what: str, size: int) -> None:
    if size > TEMPLATE_MAX_SIZE:
        raise _too_big(what, size)


def _size(value: Any) -> int:
    """The bytes a string or a container takes, as the size limit counts them."""
    if isinstance(value, (str, bytes)):
        return len(value)
    return _ITEM_BYTES * len(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else 0


def _count(value: Any) -> int:
    return len(value) if isinstance(value, Sized) else 0


def _text_size(value: Any, quoted: bool = False, indent: int = 0) -> int:
    """At least the length of what str(), repr() or JSON makes of `value` (`quoted`: a string as repr and JSON
    write it; `indent`: JSON's, a line per item), counted without recursion and only until it is over the limit."""
    total, stack = 0, [(value, 0)]
    while stack and total <= TEMPLATE_MAX_SIZE:
        item, depth = stack.pop()
        total += indent * depth + 1 if indent else 0
        if isinstance(item, str):
            total += _ESCAPED * len(item) + 2 if quoted or depth else len(item)
        elif isinstance(item, bool) or item is None:
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 32
        else:
            children = _children(item)
            total += _OBJECT_BYTES if children is None else 2 + 4 * len(children)
            if children and total <= TEMPLATE_MAX_SIZE:
                stack.extend((child, depth + 1) for child in children)
    return total


def _children(item: Any) -> list[Any] | None:
    if isinstance(item, jinja2.utils.Namespace):
        item = item._Namespace__attrs  # what its repr shows
    if isinstance(item, Mapping):
        return [*item.keys(), *item.values()]
    return list(item) if isinstance(item, (list, tuple, set, frozenset)) else None


def _materialized(value: Any) -> Any:
    """`value`, made a list if it is an iterator (a filter's lazy result), within the size limit."""
    if not isinstance(value, Iterator):
        return value
    items = []
    for item in value:
        items.append(item)
        _check_size("a sequence", _ITEM_BYTES * len(items))
    return items


def _listed(iterable: Iterable[Any]) -> list[Any]:
    """`iterable`'s items as a list, within the size limit; a sized one is refused from its length, not after
    millions of items read one by one (a 60-million-character string took 9 s, near the time limit)."""
    if isinstance(iterable, Sized):
        _check_size("a sequence", _ITEM_BYTES * len(iterable))
    return _materialized(iter(iterable))


def _counted(items: Iterator[Any]) -> Iterator[Any]:
    """A filter's lazy result (map, select, unique, ...), stopped past the items a list may hold."""
    for count, item in enumerate(items, 1):
        _check_size("a sequence", _ITEM_BYTES * count)
        yield item


def _check_arguments(args: Iterable[Any]) -> None:
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > TEMPLATE_MAX_SIZE:
            raise _over_limit(f"passed {arg} to a call, over its limit of {TEMPLATE_MAX_SIZE}")


# What each string method makes, from the string and the method's arguments; a method not listed is refused.
def _cased(s: str, *args: Any, **kwargs: Any) -> int:
    return len(s) if s.isascii() else 3 * len(s)  # a case mapping turns one character into up to three


def _same(s: str, *args: Any, **kwargs: Any) -> int:
    return len(s)


def _nothing(*args: Any, **kwargs: Any) -> int:
    return 0


def _padded(s: str, width: int, *args: Any) -> int:
    return max(len(s), width)


def _expanded(s: str, tabsize: int = 8) -> int:
    return len(s) + s.count("\t") * max(tabsize, 0)


def _replaced(s: str, old: str, new: str, count: int = -1) -> int:
    found = s.count(old) if old else len(s) + 1
    return len(s) + (found if count < 0 else min(found, count)) * max(len(new) - len(old), 0)


def _joined(s: str, iterable: Iterable[Any]) -> int:
    items = _listed(iterable)
    return sum(_text_size(item) for item in items) + len(s) * max(len(items) - 1, 0) + _ITEM_BYTES * len(items)


def _split(s: str, sep: str | None = None, maxsplit: int = -1) -> int:
    pieces = s.count(sep) + 1 if sep else len(s) // 2 + 1
    return len(s) + _OBJECT_BYTES * (pieces if maxsplit < 0 else min(pieces, maxsplit + 1))


def _lines(s: str, keepends: bool = False) -> int:
    return len(s) + _OBJECT_BYTES * (sum(s.count(c) for c in _LINE_BREAKS) + 1)


def _translated(s: str, table: Any) -> int:
    longest = max((len(v) if isinstance(v, str) else 1 for v in table.values()), default=1) \
        if isinstance(table, Mapping) else 1
    return len(s) * longest


def _formatted(s: str, *args: Any, **kwargs: Any) -> int:
    """str.format and format_map: each replacement field as long as the longest argument, or its width."""
    values = [*args, *kwargs.values()] if not (len(args) == 1 and isinstance(args[0], Mapping) and not kwargs) \
        else [*args, *args[0].values()]
    longest = max((_text_size(v) for v in values), default=0)
    widest = max((abs(v) for v in values if isinstance(v, int)), default=0)  # '{:{w}}' takes a width from them
    try:
        specs = [spec or "" for _, field, spec, _ in string.Formatter().parse(s) if field is not None]
    except ValueError:
        return len(s)  # malformed: the call fails
    return len(s) + sum(max(longest, widest, *map(int, re.findall(r"\d+", spec) or [0])) for spec in specs)


_STR_METHODS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(("count", "endswith", "find", "index", "isalnum", "isalpha", "isascii", "isdecimal", "isdigit",
                     "isidentifier", "islower", "isnumeric", "isprintable", "isspace", "istitle", "isupper", "rfind",
                     "rindex", "startswith"), _nothing),
    **dict.fromkeys(("lstrip", "rstrip", "strip", "removeprefix", "removesuffix", "partition", "rpartition"), _same),
    **dict.fromkeys(("capitalize", "casefold", "lower", "swapcase", "title", "upper"), _cased),
    **dict.fromkeys(("center", "ljust", "rjust", "zfill"), _padded),
    **dict.fromkeys(("split", "rsplit"), _split),
    **dict.fromkeys(("format", "format_map"), _formatted),
    "expandtabs": _expanded, "replace": _replaced, "join": _joined, "splitlines": _lines, "translate": _translated,
}
# Built-in methods of the other values a template holds: what each makes (a method not listed is refused).
_VALUE_METHODS: dict[tuple[type, str], Callable[[Any], int]] = {
    **{(kind, name): _nothing for kind in (list, tuple) for name in ("count", "index")},
    **{(dict, name): _nothing for name in ("get", "items", "keys", "values")},
    **{(int, name): _nothing for name in ("bit_length", "conjugate")},
    **{(float, name): _nothing for name in ("as_integer_ratio", "conjugate", "is_integer")},
    (list, "copy"): _size, (dict, "copy"): _size,
}
_JINJA_CALL_KEYWORDS = ("_loop_vars", "_block_vars")  # what jinja passes Context.call, which takes them out
_BUILTIN_CALLABLES = (types.BuiltinMethodType, types.MethodWrapperType, types.MethodDescriptorType,
                      types.WrapperDescriptorType, types.ClassMethodDescriptorType)


def _call_size(obj: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """What calling `obj` from a template makes; a RefusionError for a built-in the sandbox does not list. Python
    code (macros, jinja's helpers, our globals) runs under the line trace, and our globals check themselves."""
    method = getattr(obj, "__wrapped__", obj)  # str.format as the sandbox wraps it
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if isinstance(owner, str):  # str's methods, and Markup's wrappers of them
        if name not in _STR_METHODS:
            raise _over_limit(f"called the string method {name}, which the sandbox does not allow")
        return _STR_METHODS[name](owner, *args, **kwargs)
    if isinstance(method, _BUILTIN_CALLABLES):
        size = _VALUE_METHODS.get((type(owner), name))
        if size is None:
            kind = owner if isinstance(owner, type) else type(owner)  # a class method's owner is the class
            raise _over_limit(f"called {kind.__name__}.{name}, which the sandbox does not allow")
        return size(owner)
    return 0


# What each filter makes, from its value (an iterator already made a list) and arguments; a filter not listed is
# not there (pprint, striptags, urlencode, urlize, xmlattr: markup and debugging, a regex's time, no template's use).
def _filter_text(value: Any, *args: Any, **kwargs: Any) -> int:
    return _text_size(value)


def _filter_cased(value: Any, *args: Any, **kwargs: Any) -> int:
    return _cased(value) if isinstance(value, str) else 3 * _text_size(value)


def _filter_escaped(value: Any) -> int:
    return 5 * _text_size(value)  # &#34;


def _filter_center(value: Any, width: int = 80) -> int:
    return max(_text_size(value), width)


def _filter_indent(s: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> int:
    text = _text_size(s)
    lines = s.count("\n") + 1 if isinstance(s, str) else text
    return text + lines * (width if isinstance(width, int) else len(str(width)))


def _filter_truncate(s: Any, length: int = 255, killwords: bool = False, end: str = "...", leeway: Any = None) -> int:
    return _text_size(s) + len(str(end))


def _filter_wordwrap(s: Any, width: int = 79, break_long_words: bool = True, wrapstring: str | None = None,
                     break_on_hyphens: bool = True) -> int:
    text = _text_size(s)  # textwrap cuts it into a piece per word first
    return text * (_OBJECT_BYTES + len(wrapstring or "\n"))


def _filter_words(s: Any) -> int:
    return _OBJECT_BYTES * _text_size(s)


def _filter_replace(s: Any, old: Any, new: Any, count: int | None = None) -> int:
    return _replaced(str(s), str(old), str(new), -1 if count is None else count) if isinstance(s, str) else \
        _text_size(s) * max(len(str(new)), 1)


def _filter_format(value: Any, *args: Any, **kwargs: Any) -> int:
    return _percent_size(str(value), kwargs or args)


def _filter_join(value: Any, d: str = "", attribute: Any = None) -> int:
    return sum(_text_size(item) for item in value) + len(str(d)) * max(_count(value) - 1, 0) if \
        isinstance(value, Iterable) else _text_size(value)


def _filter_list(value: Any) -> int:
    return _OBJECT_BYTES * len(value) if isinstance(value, str) else _ITEM_BYTES * _count(value)


def _filter_items(value: Any, *args: Any, **kwargs: Any) -> int:
    return _ITEM_BYTES * _count(value)


def _filter_pairs(value: Any, *args: Any, **kwargs: Any) -> int:
    return _OBJECT_BYTES * _count(value)


def _filter_batch(value: Any, linecount: int, fill_with: Any = None) -> int:
    return _ITEM_BYTES * (_count(value) + linecount) + _OBJECT_BYTES * (_count(value) // max(linecount, 1) + 1)


def _filter_slice(value: Any, slices: int, fill_with: Any = None) -> int:
    return _ITEM_BYTES * (_count(value) + slices) + _OBJECT_BYTES * slices


def _filter_sum(iterable: Any, attribute: Any = None, start: Any = 0) -> int:
    if not isinstance(start, (int, float)):  # sum() of lists copies each prefix again: time quadratic in them
        raise _over_limit("summed values other than numbers, which the sandbox does not allow")
    return 0


def _filter_tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> int:
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    return _text_size(x, quoted=True, indent=width)


_FILTERS: dict[str, Callable[..., int]] = {
    **dict.fromkeys(("abs", "attr", "count", "d", "default", "filesizeformat", "first", "float", "int", "last",
                     "length", "max", "min", "random", "round", "items", "map", "reject", "rejectattr", "select",
                     "selectattr", "unique"), _nothing),  # a number, an item it holds, or lazy (_counted)
    **dict.fromkeys(("string", "safe", "trim"), _filter_text),
    **dict.fromkeys(("capitalize", "lower", "title", "upper"), _filter_cased),
    **dict.fromkeys(("e", "escape", "forceescape"), _filter_escaped),
    **dict.fromkeys(("reverse", "sort"), _filter_items),
    **dict.fromkeys(("dictsort", "groupby"), _filter_pairs),
    "center": _filter_center, "indent": _filter_indent, "truncate": _filter_truncate, "wordwrap": _filter_wordwrap,
    "wordcount": _filter_words, "replace": _filter_replace, "format": _filter_format, "join": _filter_join,
    "list": _filter_list, "batch": _filter_batch, "slice": _filter_slice, "sum": _filter_sum,
    "tojson": _filter_tojson,
}


def _bounded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """Filter `name` within the limits: its integer arguments, the size of what it makes (estimated before it
    runs, from its value made a list if it came lazily), and the items its own lazy result yields."""
    passes = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0  # the context or environment jinja adds
    size_of = _FILTERS[name]

    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments([*args, *kwargs.values()])
        head, value, rest = args[:passes], _materialized(args[passes]), args[passes + 1:]
        _check_size(f"the {name} filter's result", size_of(value, *rest, **kwargs))
        result = f(*head, value, *rest, **kwargs)
        return _counted(result) if isinstance(result, Iterator) else result
    return bounded


def _bounded_join(join: Callable[[Iterable[Any]], str]) -> Callable[[Iterable[Any]], str]:
    """`a ~ b` (the template module's str_join / markup_join) and a block's text (environment.concat)."""
    def bounded(parts: Iterable[Any]) -> str:
        parts = list(parts)
        _check_size("a concatenation", sum(_text_size(p) for p in parts))
        return join(parts)
    return bounded


def _bounded_output(value: Any) -> Any:
    """The environment's finalize: what `{{ ... }}` writes, checked before it becomes text."""
    _check_size("an output", _text_size(value))
    return value


def _bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's
    _check_size("lorem ipsum", builtins.max(n, 0) * builtins.max(max, 0) * _LIPSUM_WORD_BYTES)
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def _check_widths(numbers: Iterable[str]) -> None:
    """The widths and precisions of a format string (`'{:>N}'`, `'%Ns'`) within the size limit."""
    for n in numbers:
        if n and int(n) > TEMPLATE_MAX_SIZE:
            raise _over_limit(f"formats to a width of {n}, over its limit of {TEMPLATE_MAX_SIZE}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")


def _percent_size(template: str, values: Any) -> int:
    """`template % values`: each conversion as long as the longest value, or its width or precision."""
    values = [*values.values()] if isinstance(values, Mapping) else [*values] if isinstance(values, tuple) else [values]
    longest = max((_text_size(v) for v in values), default=0)
    widest = max((abs(v) for v in values if isinstance(v, int)), default=0)  # '%*s' takes its width from them
    return len(template) + sum(max(longest, widest, int(width or 0), int(precision or 0))
                               for width, precision in _PERCENT_SPEC.findall(template))


def _int_bits(value: Any) -> int:
    return abs(value).bit_length() if isinstance(value, int) and not isinstance(value, bool) else 0


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with what `*`, `**`, `+` and `%` make, the widths format strings ask for, the integers
    calls take, and what any call makes (`_call_size`) bounded."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # `value` is a str's format or format_map
            with contextlib.suppress(ValueError):  # a malformed format fails when it is called
                _check_widths(n for _, _, spec, _ in string.Formatter().parse(value.__self__) if spec
                              for n in re.findall(r"\d+", spec))
        return wrapped

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "%" and isinstance(left, str):
            _check_widths(n for m in _PERCENT_SPEC.finditer(left) for n in m.groups())
            _check_arguments(right if isinstance(right, tuple) else [right])  # '%*s' takes its width from these
            _check_size("a formatted string", _percent_size(left, right))
        elif operator == "*" and _int_bits(left) and _int_bits(right):
            if _int_bits(left) + _int_bits(right) > TEMPLATE_MAX_INT_BITS:
                raise _over_limit(f"multiplied integers of {_int_bits(left)} and {_int_bits(right)} bits, over "
                                  f"the limit of {TEMPLATE_MAX_INT_BITS}")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int):
                    _check_size("a repetition", _size(seq) * n)
        elif operator == "+":
            _check_size("a sum", _size(left) + _size(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            bits = abs(left).bit_length() * right
            if bits > TEMPLATE_MAX_INT_BITS:
                raise _over_limit(f"made a power's bits of {bits}, over its limit of {TEMPLATE_MAX_INT_BITS}")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _check_arguments([*args, *kwargs.values()])
        given = {k: v for k, v in kwargs.items() if k not in _JINJA_CALL_KEYWORDS}
        name = getattr(getattr(__obj, "__wrapped__", __obj), "__name__", "a callable")
        _check_size(f"the result of {name}()", _call_size(__obj, args, given))
        return super().call(__context, __obj, *args, **kwargs)


class _LineBudget:
    """A trace function that counts the lines the template's code runs (jinja compiles templates to Python whose
    filename is "<template>"), so loops and recursion are bounded however they are written, and reads the clock
    every _CLOCK_EVERY of those lines and of the calls of any Python function the render makes, so that a step
    inside a filter or a global (lipsum's loop calls random.choice for each word) is stopped at the time limit too;
    what runs between two of those, C code and Python that calls none, is bounded by the size checks. Past the
    limit every event raises again, so that code that catches an exception cannot carry on."""

    def __init__(self) -> None:
        self.lines = self.events = 0
        self.deadline = time.monotonic() + TEMPLATE_MAX_SECONDS
        self.expired = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        self._tick()
        return self._template_line if frame.f_code.co_filename == "<template>" else None

    def _template_line(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            self.lines += 1
            if self.lines > TEMPLATE_MAX_LINES:
                raise _over_limit(f"ran more than {TEMPLATE_MAX_LINES} lines")
            self._tick()
        return self._template_line

    def _tick(self) -> None:
        self.events += 1
        if self.expired or (self.events % _CLOCK_EVERY == 0 and time.monotonic() > self.deadline):
            self.expired = True
            raise _over_limit(f"ran for more than {TEMPLATE_MAX_SECONDS:g} s")


def render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """template.render(**variables) within the line, time and size limits."""
    previous = sys.gettrace()
    sys.settrace(_LineBudget())  # this thread only
    try:
        chunks: list[str] = []
        size = 0
        pieces: Iterator[str] = template.generate(**variables)
        for piece in pieces:
            size += len(piece)
            if size > TEMPLATE_MAX_SIZE:
                raise _over_limit(f"wrote more than {TEMPLATE_MAX_SIZE} characters")
            chunks.append(piece)
        return "".join(chunks)
    finally:
        sys.settrace(previous)
