"""The served model's tensors, declared once as data: Triton's config.pbtxt is written from this
table and requests are read against it; the inputs that are request settings are made from their rows in
runtime/core/settings.py. The names are TensorRT-LLM's (text_input, max_tokens, stop_words,
top_k, top_p, return_log_probs, stream -> text_output, output_log_probs), so genai-perf and clients written for
TensorRT-LLM models talk to it. Each input feeds one keyword of Generator.submit.

`read_request` is pure (numpy in, settings out): the Triton model calls it, tests call it directly.
`read_json` checks an HTTP body against the same table before Triton's parser sees it (the HTTP gateway).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import SETTINGS, Setting
from refusion.serve.frontend import ServeRequest


@dataclass(frozen=True)
class ServedTensor:
    name: str
    triton_type: str  # config.pbtxt data_type
    help: str
    setting: str | None = None  # the Generator.submit keyword it feeds (a decode setting or a request option)
    optional: bool = True
    many: bool = False  # a list of values (stop sequences), not one


def _triton_type(setting: Setting) -> str:
    """A setting's tensor type: an integer that may exceed INT32 (a seed) is INT64."""
    if setting.kind in ("int", "ints"):
        return "TYPE_INT64" if setting.high is not None and setting.high > 2**31 - 1 else "TYPE_INT32"
    return {"number": "TYPE_FP32", "bool": "TYPE_BOOL"}.get(setting.kind, "TYPE_STRING")


INPUTS = (
    ServedTensor("text_input", "TYPE_STRING", "the prompt (UTF-8)", optional=False),
    ServedTensor("stream", "TYPE_BOOL", "send settled text as it commits, then a final response"),
    ServedTensor("chat", "TYPE_BOOL", "wrap text_input as a user message in the model's chat template"),
    # every request setting that has a Triton input, from its row in runtime/core/settings.py
    *(ServedTensor(s.triton, _triton_type(s), s.help, s.name, many=s.kind in ("strings", "ints"))
      for s in SETTINGS if s.triton),
)
OUTPUTS = (
    ServedTensor("text_output", "TYPE_STRING", "settled text: a piece per streamed response, all of it otherwise"),
    ServedTensor("token_ids", "TYPE_INT64", "the answer's ids: no EOS, no stop token (final response)"),
    ServedTensor("finish_reason", "TYPE_STRING", "eos, length, stop, timeout or cancelled (final response)"),
    ServedTensor("cached_prompt_tokens", "TYPE_INT32", "prompt tokens reused from the prefix cache (final response)"),
    ServedTensor("output_log_probs", "TYPE_FP32", "each token's log-probability, with return_log_probs (final)"),
)
INPUT_NAMES = tuple(spec.name for spec in INPUTS)
_KINDS = {"TYPE_STRING": "OSU", "TYPE_BOOL": "b", "TYPE_INT32": "iu", "TYPE_INT64": "iu", "TYPE_FP32": "f"}
_EXPECTED = {"TYPE_STRING": "a string", "TYPE_BOOL": "a boolean", "TYPE_INT32": "an integer",
             "TYPE_INT64": "an integer", "TYPE_FP32": "a number"}


def read_request(tensors: Mapping[str, np.ndarray]) -> ServeRequest:
    """A request's input tensors as prompt and settings; a RefusionError names the bad tensor."""
    values = {spec.name: _values(spec, tensors[spec.name]) if spec.many else _scalar(spec, tensors[spec.name])
              for spec in INPUTS if spec.name in tensors}
    if "text_input" not in values:
        raise RefusionError("text_input is missing: send the prompt as text_input (a string).")
    settings = {spec.setting: values[spec.name] for spec in INPUTS if spec.setting and spec.name in values}
    return ServeRequest(values["text_input"], bool(values.get("stream", False)), bool(values.get("chat", False)),
                        settings)


def _values(spec: ServedTensor, array: np.ndarray) -> list[Any]:
    """Every value of a list tensor (stop sequences), each of the declared type."""
    return [_scalar(spec, np.asarray([value])) for value in np.asarray(array).reshape(-1)]


_JSON_KINDS = {"TYPE_STRING": (str,), "TYPE_BOOL": (bool,), "TYPE_INT32": (int,), "TYPE_INT64": (int,),
               "TYPE_FP32": (int, float)}
_INT_BITS = {"TYPE_INT32": 32, "TYPE_INT64": 64}
_FP32_MAX = float(np.finfo(np.float32).max)


def read_json(body: Mapping[str, Any], streaming: bool) -> dict[str, Any]:
    """An HTTP generate (`streaming` False) or generate_stream body, checked against the inputs: each field one
    of ours, each value one JSON value of its tensor's type and range (no integer wraps into INT32 on the way),
    or for a list tensor (stop_words) a list of them. A RefusionError names the field."""
    for name in body:
        if name not in INPUT_NAMES:
            close = difflib.get_close_matches(name, INPUT_NAMES, 1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RefusionError(f"{name!r} is not an input of this model; {hint}it takes {', '.join(INPUT_NAMES)}.")
    for spec in INPUTS:
        if spec.name in body:
            value = body[spec.name]
            for item in value if spec.many and isinstance(value, list) else [value]:
                _check_json(spec, item)
    if "text_input" not in body:
        raise RefusionError("text_input is missing: send the prompt as text_input (a string).")
    if body.get("stream") and not streaming:
        raise RefusionError('"stream": true needs generate_stream: generate answers with one response; POST to '
                            ".../generate_stream, or leave stream out.")
    return dict(body)


def _check_json(spec: ServedTensor, value: Any) -> None:
    kinds = _JSON_KINDS[spec.triton_type]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."
        raise RefusionError(f"{spec.name} is a JSON {type(value).__name__} ({shown}); it must be "
                            f"{_EXPECTED[spec.triton_type]} ({spec.triton_type}): {spec.help}.")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RefusionError(f"{spec.name} holds a lone surrogate ({value[e.start]!r} at character {e.start}), "
                                "which is not text; send UTF-8 text.") from None
    bits = _INT_BITS.get(spec.triton_type)
    if bits is not None and not -(1 << (bits - 1)) <= value < 1 << (bits - 1):
        raise RefusionError(f"{spec.name}={value} does not fit {spec.triton_type} "
                            f"[{-(1 << (bits - 1))}, {(1 << (bits - 1)) - 1}]: {spec.help}.")
    if spec.triton_type == "TYPE_FP32" and not (math.isfinite(value) and abs(value) <= _FP32_MAX):
        raise RefusionError(f"{spec.name}={value} is not a finite float32: {spec.help}.")


def _scalar(spec: ServedTensor, array: np.ndarray) -> Any:
    """One value of the declared type (a Triton request is one prompt: the batch is our scheduler's job)."""
    array = np.asarray(array)
    if array.size != 1:
        raise RefusionError(f"{spec.name} holds {array.size} values (shape {list(array.shape)}); send exactly one: "
                            "each request is one prompt, and concurrent requests are batched by the server.")
    value = array.reshape(-1)[0]
    kind = array.dtype.kind
    if kind not in _KINDS[spec.triton_type] or (kind == "O" and not isinstance(value, (bytes, str))):
        raise RefusionError(f"{spec.name} is {array.dtype} ({value!r}); it must be {_EXPECTED[spec.triton_type]} "
                            f"({spec.triton_type}): {spec.help}.")
    if spec.triton_type == "TYPE_STRING":
        try:
            return value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError as e:
            raise RefusionError(f"{spec.name} is not valid UTF-8 ({e.reason} at byte {e.start}).") from e
    if spec.triton_type == "TYPE_FP32":
        return float(str(value))  # the shortest decimal of the float32: 0.9 stays 0.9, not 0.8999999761...
    return bool(value) if spec.triton_type == "TYPE_BOOL" else int(value)


def config_pbtxt(model_name: str) -> str:
    """Triton's model configuration: a decoupled (streaming) Python-backend model with these tensors, and no
    Triton batching (max_batch_size 0: requests reach our scheduler one by one, which batches their forwards
    step by step). No parameters: clients may read this, and the model's settings hold host paths."""
    def tensor(spec: ServedTensor) -> str:
        optional = " optional: true" if spec.optional and spec in INPUTS else ""
        return f'  {{ name: "{spec.name}" data_type: {spec.triton_type} dims: [ -1 ]{optional} }}'

    return "\n".join([
        f'name: "{model_name}"', 'backend: "python"', "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        "input [", ",\n".join(tensor(s) for s in INPUTS), "]",
        "output [", ",\n".join(tensor(s) for s in OUTPUTS), "]",
        "instance_group [ { count: 1 kind: KIND_CPU } ]",  # one Generator; its engine thread runs every request
        "",
    ])
