"""Tokenizer and chat template for the runtime, without torch or transformers.

Reproduces `AutoTokenizer.from_pretrained(dir)` + `apply_chat_template(..., tokenize=False)`
of transformers 5 for Qwen2/Qwen3-style byte-level BPE checkpoints, using only the
`tokenizers` library and jinja2. The jinja environment mirrors transformers'
`_cached_compile_jinja_template`, so a checkpoint's template renders to the same text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import re
import string
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from types import FrameType
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.signals import main_thread_signals

# Every tokenizer file a checkpoint may carry; the exporter copies those that exist.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
)

# transformers' named special tokens; their strings are passed to every chat template.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What Qwen2Tokenizer (the class Qwen2/Qwen3 configs name) assumes for keys the config omits.
_QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
# Qwen2's pre-tokenization regex, needed to rebuild the tokenizer from vocab.json + merges.txt.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Older names for a message's reasoning; transformers copies them to `reasoning_content`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# Unicode normalization (NFC, NFKC, lowercasing: the normalizers of this family's tokenizers) shrinks UTF-8
# text at most 3x: three Hangul jamo of 3 bytes compose into one syllable of 3, a fullwidth letter becomes ASCII.
_NORMALIZED_SHRINK = 3
_CHARACTER_BYTES = 4  # an unknown character becomes one token: at most 4 bytes of UTF-8


class Tokenizer:
    """Encode, decode and render chat prompts for one checkpoint's tokenizer directory."""

    def __init__(self, backend: _Backend, special_tokens: dict[str, str], chat_template: str | dict | None):
        self._backend = backend
        # Named special tokens (eos_token, pad_token, ...) as strings, like transformers' special_tokens_map.
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        eos = special_tokens.get("eos_token")
        self.eos_token_id: int | None = backend.token_to_id(eos) if eos is not None else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        if not root.is_dir():
            raise RefusionError(
                f"tokenizer directory {str(root)!r} does not exist or is not a directory; "
                "pass the checkpoint or export folder that holds tokenizer.json or vocab.json + merges.txt"
            )
        config = _read_json(root / "tokenizer_config.json")  # optional, as for transformers
        if config is None:
            config = {}
        elif not isinstance(config, dict):
            raise _corrupt(root / "tokenizer_config.json", "its top level is not a JSON object")
        added = _added_tokens(root, config)  # may merge special_tokens_map.json into config
        backend = _load_backend(root)
        # Qwen2Tokenizer fills its defaults only for keys the config leaves out (an explicit null stays None).
        defaults = _QWEN2_DEFAULTS if str(config.get("tokenizer_class", "")).startswith("Qwen2Tokenizer") else {}
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = _token_content(config[key] if key in config else defaults.get(key))
            if value is not None:
                special[key] = value
        _add_tokens(backend, added, special.values())
        # split_special_tokens=True makes transformers encode "<|im_end|>" in text as plain text.
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        return cls(backend, special, _read_chat_template(root, config))

    # --- tokens -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, as transformers' `tokenizer(text)["input_ids"]`."""
        # encode_batch gives the same ids and releases the GIL while it works (encode holds it), so a long
        # prompt tokenized on one thread does not stall the scheduler's. Its first call starts the tokenizers
        # library's thread pool: inside main_thread_signals, so the pool takes no Ctrl-C.
        with main_thread_signals():
            return self._backend.encode_batch([text])[0].ids

    @cached_property
    def longest_token_bytes(self) -> int:
        """At least the UTF-8 bytes of input text any one token stands for: the longest vocabulary entry in
        UTF-8 (byte-level alphabets spell each byte with one or two characters, so they over-count), or one
        unknown character."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max(_CHARACTER_BYTES, *(len(t.encode("utf-8", "surrogatepass")) for t in vocab))

    def max_text_bytes(self, tokens: int) -> int:
        """No text of more UTF-8 bytes than this tokenizes to `tokens` tokens or fewer: each token stands for at
        most `longest_token_bytes` of normalized text, and normalization shrinks text at most 3x."""
        return tokens * self.longest_token_bytes * _NORMALIZED_SHRINK

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # transformers skips its clean_up_tokenization step for BPE, so the backend's text is final.
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    # --- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text transformers' `apply_chat_template(..., tokenize=False)` renders.

        enable_thinking=None leaves the variable undefined in the template; other keyword
        arguments become template variables, as in transformers.
        """
        source = self._template_for(tools)
        if not messages:
            raise RefusionError("apply_chat_template got an empty conversation; pass at least one message")
        chat = []
        for message in messages:
            # transformers drops None-valued keys: templates treat a missing key better than a None one.
            message = _plain(message)
            if not isinstance(message, dict):
                raise RefusionError(
                    f"chat message {message!r} is not a dict; pass messages like {{'role': 'user', 'content': '...'}}"
                )
            chat.append(_alias_reasoning({k: v for k, v in message.items() if v is not None}))
        for name, items in (("tools", tools), ("documents", documents)):
            if items is not None and not all(isinstance(item, Mapping) for item in items):
                raise RefusionError(f"every entry of {name}= must be a dict (a JSON schema for tools); got {items!r}")
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        variables = {**self.special_tokens, **_plain(kwargs)}  # caller's kwargs win, as in transformers
        template = _compile(source)
        try:
            return _bounded_render(template, dict(
                messages=chat,
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            ))
        except RefusionError:
            raise
        except Exception as e:
            raise RefusionError(
                f"the chat template failed on these messages: {type(e).__name__}: {e}; "
                "check the message roles/fields against the template, or pass raw text or token ids instead"
            ) from e

    def _template_for(self, tools: object) -> str:
        template = self.chat_template
        if isinstance(template, dict):  # named templates; transformers' selection rule
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            if name not in template:
                raise RefusionError(
                    f"the checkpoint has chat templates {sorted(template)} but none named 'default'; "
                    "add a chat_template.jinja or pass raw text or token ids instead"
                )
            template = template[name]
        if not template:
            raise RefusionError(
                "the checkpoint has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); pass raw text or token ids instead of chat messages"
            )
        return template


# --- loading --------------------------------------------------------------------------------


def _corrupt(path: Path, why: str) -> RefusionError:
    return RefusionError(
        f"tokenizer file {str(path)!r} is corrupt ({why}); re-copy it from the original checkpoint "
        "or re-save the tokenizer with transformers' save_pretrained"
    )


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it does not exist."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, str(e)) from e


def _token_content(value: Any) -> str | None:
    # Configs store special tokens as strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return None if value is None else str(value)


def _added_tokens(root: Path, config: dict) -> dict[int, AddedToken]:
    """Added tokens by id, read like transformers does: from the config, else from the legacy files."""
    if "added_tokens_decoder" in config:
        decoder = config["added_tokens_decoder"]
        try:
            return {
                int(i): AddedToken(**{k: t[k] for k in _ADDED_TOKEN_FIELDS if k in t}) for i, t in decoder.items()
            }
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            raise _corrupt(root / "tokenizer_config.json", f"bad added_tokens_decoder: {e}") from e
    # Legacy checkpoints: special_tokens_map.json overrides the config's named tokens...
    special_map = _read_json(root / "special_tokens_map.json") or {}
    config.update({k: v for k, v in special_map.items() if k in _SPECIAL_TOKEN_KEYS})
    # ...and added_tokens.json lists {token: id}; special ones are the named special tokens.
    specials = {_token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
    added = _read_json(root / "added_tokens.json") or {}
    try:
        return {
            int(i): AddedToken(t, special=t in specials, normalized=t not in specials) for t, i in added.items()
        }
    except (AttributeError, TypeError, ValueError) as e:
        raise _corrupt(root / "added_tokens.json", f"expected {{token: id}}: {e}") from e


def _load_backend(root: Path) -> _Backend:
    path = root / "tokenizer.json"
    if path.is_file():
        try:
            return _Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise _corrupt(path, str(e)) from e
    vocab, merges = root / "vocab.json", root / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        missing = [p.name for p in (vocab, merges) if not p.is_file()]
        raise RefusionError(
            f"tokenizer directory {str(root)!r} has no tokenizer.json and lacks {' and '.join(missing)}; "
            "copy the tokenizer files from the original checkpoint (tokenizer.json, or vocab.json + merges.txt)"
        )
    try:
        vocab_map, merge_list = BPE.read_file(str(vocab), str(merges))
    except Exception as e:
        raise _corrupt(vocab if "json" in str(e).lower() else merges, str(e)) from e
    # The pipeline transformers' Qwen2Tokenizer builds around vocab.json + merges.txt.
    backend = _Backend(BPE(vocab_map, merge_list, unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_tokens(backend: _Backend, added: dict[int, AddedToken], special: Iterable[str]) -> None:
    # In id order, so tokens appended after the BPE vocab land on the ids the config declares.
    for token_id, token in sorted(added.items()):
        if backend.token_to_id(token.content) is None:
            backend.add_tokens([token])
        got = backend.token_to_id(token.content)
        if got != token_id:
            raise RefusionError(
                f"added token {token.content!r} is declared with id {token_id} but the vocabulary gives it id {got}; "
                "the tokenizer files disagree, re-copy them together from the original checkpoint"
            )
    # Named special tokens that are not added tokens yet become special ones, as in transformers.
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    backend.add_tokens([AddedToken(c, special=True) for c in dict.fromkeys(special) if c not in present])


def _read_chat_template(root: Path, config: dict) -> str | dict | None:
    # transformers 5 saves chat_template.jinja and prefers it over the config's entry.
    path = root / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise _corrupt(path, str(e)) from e
    template = config.get("chat_template")
    if isinstance(template, list):  # older multi-template form: [{"name": ..., "template": ...}]
        try:
            return {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError) as e:
            raise _corrupt(root / "tokenizer_config.json", f"bad chat_template list: {e}") from e
    return template


# --- template data --------------------------------------------------------------------------


def _plain(value: Any) -> Any:
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
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    np = sys.modules.get("numpy")  # a numpy scalar can only exist if numpy is already imported
    if np is not None and isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic, e.g. OpenAI SDK messages
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
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
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


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
def _compile(source: str) -> jinja2.Template:
    # Templates come from downloaded checkpoints: older jinja2 has known sandbox escapes.
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise RefusionError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes; run `pip install -U 'jinja2>=3.1.6'`"
        )
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_call(f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
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


# --- bounds on what a template may do: the sandbox stops escapes, these stop a template that hangs or
# fills memory ('a' * 10**8, range(100000) nested twice). A real chat template stays far below them.
TEMPLATE_MAX_LINES = 2_000_000  # template code lines run per render (loops, macros)
TEMPLATE_MAX_SECONDS = 10.0  # wall clock per render, checked every _CLOCK_EVERY lines
TEMPLATE_MAX_SIZE = 64 << 20  # the longest string or list an operator, filter or call may make; the output's bytes
_CLOCK_EVERY = 1000


def _over_limit(what: str) -> RefusionError:
    return RefusionError(f"the chat template {what}; it loops without end or is hostile: fix chat_template.jinja")


def _too_big(what: str, size: int) -> RefusionError:
    return _over_limit(f"made {what} of {size}, over its limit of {TEMPLATE_MAX_SIZE}")


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_arguments(args: Iterable[Any]) -> None:
    for arg in args:
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > TEMPLATE_MAX_SIZE:
            raise _over_limit(f"passed {arg} to a call, over its limit of {TEMPLATE_MAX_SIZE}")


def _bounded_call(f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter whose integer arguments (a width, a count) stay within the size limit."""
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments([*args, *kwargs.values()])
        return f(*args, **kwargs)
    return bounded


def _bounded_join(join: Callable[[Iterable[Any]], str]) -> Callable[[Iterable[Any]], str]:
    def bounded(parts: Iterable[Any]) -> str:
        parts = list(parts)
        size = sum(_size(p) for p in parts)
        if size > TEMPLATE_MAX_SIZE:
            raise _too_big("a concatenation", size)
        return join(parts)
    return bounded


def _check_widths(numbers: Iterable[str]) -> None:
    """The widths and precisions of a format string (`'{:>N}'`, `'%Ns'`) within the size limit."""
    for n in numbers:
        if n and int(n) > TEMPLATE_MAX_SIZE:
            raise _over_limit(f"formats to a width of {n}, over its limit of {TEMPLATE_MAX_SIZE}")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d*)(?:\.(\d*))?")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with the size of what `*`, `**`, `+` and `%` make, the widths format strings ask
    for, and the integers calls take, bounded."""

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
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int) and _size(seq) * n > TEMPLATE_MAX_SIZE:
                    raise _too_big("a repetition", _size(seq) * n)
        elif operator == "+" and _size(left) + _size(right) > TEMPLATE_MAX_SIZE:
            raise _too_big("a sum", _size(left) + _size(right))
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            bits = abs(left).bit_length() * right
            if bits > TEMPLATE_MAX_SIZE:
                raise _too_big("a power's bits", bits)
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        _check_arguments([*args, *kwargs.values()])
        return super().call(__context, __obj, *args, **kwargs)


class _LineBudget:
    """A trace function counting the lines template code runs (jinja compiles templates to Python whose
    filename is "<template>"), so loops and recursion are bounded however they are written."""

    def __init__(self) -> None:
        self.lines = 0
        self.deadline = time.monotonic() + TEMPLATE_MAX_SECONDS

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        return self._line if frame.f_code.co_filename == "<template>" else None

    def _line(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line":
            self.lines += 1
            if self.lines > TEMPLATE_MAX_LINES:
                raise _over_limit(f"ran more than {TEMPLATE_MAX_LINES} lines")
            if self.lines % _CLOCK_EVERY == 0 and time.monotonic() > self.deadline:
                raise _over_limit(f"ran for more than {TEMPLATE_MAX_SECONDS:.0f} s")
        return self._line


def _bounded_render(template: jinja2.Template, variables: dict[str, Any]) -> str:
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
