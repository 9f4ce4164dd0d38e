"""Every setting a request carries, declared once as data: one `Setting` row per knob.

Its name, kind and bounds, default, help, whether an export records it, which strategies read it, whether it
is a decode setting (DecodeParams) or a request option (RequestOptions), and its names on the wires. Everything
else reads these rows: the validation of DecodeParams, RequestOptions and DecodeDefaults, the defaults of the
engines' DecodeLimits, each strategy's settings (runtime/decode/), the OpenAI server's fields
(serve/openai/schema.py), Triton's inputs (serve/triton/tensors.py), the CLIs' options (tools/cli_common.py)
and chat's /settings (tools/chat.py); tests/runtime/core/test_settings.py holds every one of them, and the docs'
tables, to the rows. docs/architecture.md, "How to add a request setting", says what else a new row needs.
(llama.cpp's server reads each field once, in params_from_json_cmpl; nano-vllm's SamplingParams.)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Literal, get_args

from refusion.runtime.core.errors import RefusionError, refusing
from refusion.runtime.core.nesting import MAX_JSON_DEPTH, json_depth, value_depth

Kind = Literal["int", "number", "bool", "string", "strings", "ints", "text", "json"]
Role = Literal["decode", "request"]
Mode = Literal["refusion", "ar"]  # the public strategies: runtime/decode/'s table holds a row for each (a test)
MODES: tuple[Mode, ...] = get_args(Mode)
INT64 = (-(2**63), 2**64 - 1)  # what a seed may be: any int64, or its unsigned bits
GUIDE_BYTES = 65536  # the most UTF-8 bytes a guide (a schema, a regex, a grammar, the choices) may hold


@dataclass(frozen=True)
class Setting:
    name: str
    kind: Kind
    help: str  # what it does, in one line: the CLIs', the servers' and chat's help
    default: Any = None  # left out (None for seed, max_tokens, timeout_s: none)
    role: Role = "decode"  # decode: a DecodeParams field; request: a RequestOptions field
    low: float | None = None  # bounds, inclusive unless `open` names the side
    high: float | None = None
    open: Literal["", "low", "high"] = ""
    choices: tuple[str, ...] | None = None
    note: str = ""  # appended to a refusal: why the bound, or an example
    recorded: bool = False  # an export records its value (refusion.json `defaults`): left out, a request takes it
    strategies: tuple[str, ...] = MODES  # the strategies whose steps read it (decode settings; mode: none, it picks)
    aliases: tuple[str, ...] = ()  # former names, still taken by the CLIs (--serial-blocks) and chat
    short: str | None = None  # chat's short key (/settings k=4)
    cli: str | None = None  # its CLI option, if not --name with dashes (None); "": none (a command words its own)
    openai: tuple[str, ...] = ()  # its OpenAI field names: OpenAI's own first (an alias after it), or ()
    openai_extra: bool = False  # a ReFusion field beside OpenAI's (the openai client: extra_body)
    triton: str | None = None  # its Triton input (TensorRT-LLM's name where one exists), or None
    cli_file: bool = False  # its CLI option names a FILE that holds the value (a JSON schema, a grammar)
    guide: bool = False  # a structured-output guide (runtime/structured/guide.py): a request takes one at most

    @property
    def optional(self) -> bool:
        """None is a value of it: left out, there is none."""
        return self.default is None and not self.recorded

    @property
    def flag(self) -> str:
        """Its CLI option."""
        return self.cli if self.cli else "--" + self.name.replace("_", "-")

    def expected(self) -> str:
        """What a value must be, in words."""
        if self.choices is not None:
            return f"one of {', '.join(map(repr, self.choices))}"
        if self.kind == "bool":
            text = "True or False"
        elif self.kind == "text":
            text = f"a non-empty string of at most {self.high:g} bytes"
        elif self.kind == "json":
            text = f"a JSON object (or its JSON text) of at most {self.high:g} bytes"
        elif self.kind == "strings":
            text = "a string or a list of non-empty strings"
        elif self.kind == "ints":
            text = "a list of integers" + (f" >= {self.low:g}" if self.low is not None else "")
        elif self.kind == "int" and self.low == 1 and self.high is None:
            text = "a positive integer"
        elif self.low is not None and self.high is not None:
            what = "an integer" if self.kind == "int" else "a number"
            text = f"{what} in {self._range()}"
        elif self.kind == "number" and self.low == 0 and self.open == "low":
            text = "a positive number"
        elif self.kind == "number":  # a lower bound alone
            text = f">= {self.low:g} and finite"
        else:
            text = f"an integer >= {self.low:g}"
        return text + (", or None" if self.optional else "")

    def _range(self) -> str:
        if self.high is not None and self.high >= 2**53:
            return "[-2**63, 2**64)"
        left, right = "(" if self.open == "low" else "[", ")" if self.open == "high" else "]"
        return f"{left}{self.low:g}, {self.high:g}{right}"

    def refusal(self, value: Any, outside: bool = False) -> RefusionError:
        """The error for `value`: of the right kind but `outside` a range of two bounds, or not what it must be."""
        note = f" ({self.note})" if self.note else ""
        if outside:
            return RefusionError(f"{self.name}={value!r} is outside {self._range()}{note}.", self.name)
        return RefusionError(f"{self.name}={value!r} must be {self.expected()}{note}.", self.name)

    def check(self, value: Any) -> Any:
        """`value` as this setting holds it (plain Python, tuples for lists), or its refusal naming it."""
        with refusing(self.name):
            return self._checked(value)

    def _checked(self, value: Any) -> Any:
        if value is None and self.optional:
            return None
        if self.choices is not None:
            if value not in self.choices:
                raise RefusionError(f"{self.name}={value!r} is not one of {', '.join(map(repr, self.choices))}.")
            return value
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise self.refusal(value)
            return value
        if self.kind == "strings":
            return self._strings(value)
        if self.kind == "ints":
            return self._ints(value)
        if self.kind in ("text", "json"):
            return self._text(value)
        whole = self.kind == "int"
        if not (_is_int(value) if whole else _is_number(value) and math.isfinite(value)):
            raise self.refusal(value)
        if not self._within(value):
            raise self.refusal(value, outside=self.kind == "number" and self.low is not None and self.high is not None)
        return int(value) if whole else float(value)  # numpy scalars become plain, JSON-safe numbers

    def _within(self, value: Any) -> bool:
        low, high = self.low, self.high
        if low is not None and (value < low or (self.open == "low" and value == low)):
            return False
        return high is None or (value <= high and not (self.open == "high" and value == high))

    def _strings(self, value: Any) -> tuple[str, ...]:
        values = (value,) if isinstance(value, str) else value
        if not isinstance(values, Iterable) or isinstance(values, (bytes, dict)):
            raise self.refusal(value)
        values = tuple(values)
        if not values and self.guide:  # a guide given holds something: none would leave the answer unguided
            raise RefusionError(f"{self.name}=[] holds no strings; give at least one ({self.note}).")
        bad = [s for s in values if not isinstance(s, str) or not s]
        if bad:
            raise RefusionError(f"{self.name}={value!r} holds {bad[0]!r}; each must be a non-empty string "
                                f"({self.note}).")
        return values

    def _text(self, value: Any) -> str:
        """A text setting as given; a JSON one as its compact JSON text (a dict or list given, or text that parses
        to one): one spelling, which caches and compares. A JSON one nests at most MAX_JSON_DEPTH deep, as a
        server's body does, measured before json.loads or json.dumps recurses into it."""
        if self.kind == "json" and isinstance(value, dict):
            self._shallow(value_depth(value))
            try:
                value = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise RefusionError(f"{self.name}={_shown(value)} is not JSON ({e}); it must be {self.expected()}.") from None
        if not isinstance(value, str) or not value:
            raise self.refusal(value)
        if self.kind == "json":
            self._shallow(json_depth(value.encode("utf-8", "surrogatepass")))
            try:
                parsed = json.loads(value)
            except ValueError as e:
                raise RefusionError(f"{self.name}={_shown(value)} is not JSON text ({e}); it must be "
                                    f"{self.expected()}.") from None
            if not isinstance(parsed, dict):
                raise self.refusal(value)
            value = json.dumps(parsed, ensure_ascii=False, separators=(",", ":"))
        if self.high is not None and len(value.encode("utf-8", "surrogatepass")) > self.high:
            raise RefusionError(f"{self.name} holds {len(value.encode('utf-8', 'surrogatepass'))} bytes, over the "
                                f"{self.high:g} a request may send ({self.note}).")
        return value

    def _shallow(self, depth: int) -> None:
        if depth > MAX_JSON_DEPTH:
            raise RefusionError(f"{self.name} nests {depth} deep, over the limit of {MAX_JSON_DEPTH} ({self.note}); "
                                "give a flatter one: a schema can name a part once in $defs and use it by $ref.")

    def _ints(self, value: Any) -> tuple[int, ...]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise self.refusal(value)
        values = tuple(value)
        bad = [t for t in values if not _is_int(t) or (self.low is not None and t < self.low)]
        if bad:
            raise RefusionError(f"{self.name}={value!r} holds {bad[0]!r}; it must be {self.expected()} "
                                f"({self.note}).")
        return tuple(int(t) for t in values)


SETTINGS = (
    # -- the canvas and ReFusion's expert settings: an export records these five ------------------------------
    Setting("gen_length", "int", "ReFusion's canvas (the expert's setting; max_tokens caps the answer): positions "
            "decoded, padded to whole slots and cut into serial_num_blocks blocks; AR: tokens at most", 512, low=1,
            recorded=True, openai=("gen_length",), openai_extra=True, triton="gen_length"),
    Setting("slot_size", "int", "tokens per slot: a slot is drafted and committed as a unit", 32, low=1,
            recorded=True, strategies=("refusion",), short="k", openai=("slot_size",), openai_extra=True,
            triton="slot_size"),
    Setting("serial_num_blocks", "int", "equal blocks the canvas is cut into, decoded in turn", 4, low=1,
            recorded=True, strategies=("refusion",), aliases=("serial_blocks",), short="blocks",
            openai=("serial_num_blocks",), openai_extra=True, triton="serial_num_blocks"),
    Setting("slot_threshold", "number", "a slot is chosen when its first token's draft probability exceeds it",
            0.9, low=0, high=1, note="it is compared against a probability", recorded=True,
            strategies=("refusion",), openai=("slot_threshold",), openai_extra=True, triton="slot_threshold"),
    Setting("token_threshold", "number", "a drafted token is accepted when its AR probability exceeds it", 0.4,
            low=0, high=1, note="it is compared against a probability", recorded=True, strategies=("refusion",),
            openai=("token_threshold",), openai_extra=True, triton="token_threshold"),
    # -- sampling ------------------------------------------------------------------------------------------------
    Setting("temperature", "number", "0 is greedy; > 0 samples (Gumbel-max) from the export's top-K candidates",
            0.0, low=0, note="0 is greedy; e.g. 0.7 samples", openai=("temperature",), triton="temperature"),
    Setting("seed", "int", "seed of the sampling noise, any int64: the same seed, the same draws", low=INT64[0],
            high=INT64[1], note="it seeds the sampling noise", openai=("seed",), triton="seed"),
    Setting("mode", "string", "decoding: refusion (plan, verify, infill) or ar (one token a forward)",
            "refusion", choices=MODES, strategies=(), openai=("mode",), openai_extra=True, triton="mode"),
    Setting("max_tokens", "int", "at most this many new tokens (any N >= 1 that fits the positions); it only cuts",
            low=1, note="the most new tokens to return", openai=("max_tokens", "max_completion_tokens"),
            triton="max_tokens"),
    Setting("top_k", "int", "with temperature > 0: draw among the k most likely candidates (0: all the export's)",
            0, low=0, note="0: every candidate the export emits", openai=("top_k",), openai_extra=True,
            triton="top_k"),
    Setting("top_p", "number", "with temperature > 0: among the fewest candidates whose probability reaches it "
            "(1: no cut; 0: the most likely alone)", 1.0, low=0, high=1, note="1: no nucleus cut",
            openai=("top_p",), triton="top_p"),
    Setting("min_p", "number", "with temperature > 0: among those at least min_p x the most likely's probability "
            "(0: no cut)", 0.0, low=0, high=1, open="high", note="0: no cut", openai=("min_p",), openai_extra=True,
            triton="min_p"),
    Setting("upstream_eos_drop", "bool", "ReFusion: after an EOS found in infill, drop slots as upstream does, "
            "leaving positions before the EOS undecoded (for comparing with the upstream code)", False,
            strategies=("refusion",), openai=("upstream_eos_drop",), openai_extra=True, triton="upstream_eos_drop"),
    # -- request options: where the answer stops, what the result carries, the deadline --------------------------
    Setting("stop", "strings", "stop sequences: the answer ends before the first, which is not returned", (),
            role="request", note="e.g. stop=['\\n\\n', 'User:']", cli="--stop", openai=("stop",),
            triton="stop_words"),
    Setting("stop_token_ids", "ints", "token ids that end the answer (not returned)", (), role="request", low=0,
            note="token ids are non-negative", cli="--stop-token-id", openai=("stop_token_ids",), openai_extra=True,
            triton="stop_token_ids"),
    Setting("logprobs", "bool", "the result carries each returned token's log-probability", False, role="request",
            cli="", openai=("logprobs",), triton="return_log_probs"),
    Setting("top_logprobs", "int", "with logprobs: this many alternatives to each token (at most the export's "
            "candidates)", 0, role="request", low=0, note="alternatives reported beside each token", cli="",
            openai=("top_logprobs",)),
    Setting("timeout_s", "number", "a deadline in seconds: the answer ends there with what had settled",
            role="request", low=0, open="low", note="seconds", cli="--timeout", openai=("timeout_s",),
            openai_extra=True, triton="timeout_s"),
    # -- structured output: the answer follows one guide, or the request is refused (docs/decoding.md) ----------
    Setting("json_schema", "json", "the answer is JSON valid under this JSON schema", role="request",
            high=GUIDE_BYTES, note="a guide is bounded", cli_file=True, openai=("guided_json",), openai_extra=True,
            triton="json_schema", guide=True),
    Setting("regex", "text", "the answer matches this regular expression whole", role="request",
            high=GUIDE_BYTES, note="a guide is bounded", openai=("guided_regex",), openai_extra=True, triton="regex",
            guide=True),
    Setting("choice", "strings", "the answer is one of these strings", role="request",
            note="e.g. choice=['yes', 'no']", openai=("guided_choice",), openai_extra=True, triton="choice",
            guide=True),
    Setting("grammar", "text", "the answer follows this grammar (Lark, or llama.cpp's GBNF)", role="request",
            high=GUIDE_BYTES, note="a guide is bounded", cli_file=True, openai=("guided_grammar",), openai_extra=True,
            triton="grammar", guide=True),
)
BY_NAME = {setting.name: setting for setting in SETTINGS}
DEFAULTS = {setting.name: setting.default for setting in SETTINGS}
DECODE = tuple(s for s in SETTINGS if s.role == "decode")
REQUEST = tuple(s for s in SETTINGS if s.role == "request")
RECORDED = tuple(s for s in SETTINGS if s.recorded)
GUIDES = tuple(s for s in SETTINGS if s.guide)
ALIASES = {alias: setting.name for setting in SETTINGS for alias in (*setting.aliases, setting.short or "") if alias}


def _shown(value: Any) -> str:
    """A value in an error message, cut to a line."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def read_by(strategy: str) -> tuple[str, ...]:
    """The decode settings a strategy's steps read."""
    return tuple(s.name for s in DECODE if strategy in s.strategies)


def _is_int(value: object) -> bool:
    """An integer, numpy's included, but not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)
