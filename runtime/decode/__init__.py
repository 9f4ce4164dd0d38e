"""The decode strategies, each a step machine (decode/steps.py): ReFusion (decode/refusion.py),
autoregressive (decode/ar.py) and the LLaDA-style baseline (decode/llada.py). `run_on` drives one on
a Runner directly; the engine (runtime/engine.py) drives many at once."""

from __future__ import annotations

from collections.abc import Iterator

from refusion.runtime.decode import ar, refusion
from refusion.runtime.decode.ar import ar_steps
from refusion.runtime.decode.refusion import refusion_steps
from refusion.runtime.decode.steps import Commit, DecodeTrace, Forward, KVMove, Outputs, StepMachine, Tokens
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners.base import Runner

__all__ = ["DecodeTrace", "Tokens", "ar_decode", "kv_capacity", "refusion_decode", "run_on", "steps_for"]


def kv_capacity(prompt_length: int, params: DecodeParams) -> int:
    """KV tokens a request of params.mode needs."""
    return (ar if params.mode == "ar" else refusion).kv_capacity(prompt_length, params)


def steps_for(tokens: Tokens, params: DecodeParams, trace: DecodeTrace, logits: bool) -> StepMachine:
    """The step machine of params.mode."""
    strategy = refusion_steps if params.mode == "refusion" else ar_steps
    return strategy(tokens, params, trace, logits)


def run_on(runner: Runner, steps: StepMachine, capacity: int, slot: int = 0) -> Iterator[Commit]:
    """Drive one step machine on `runner`'s KV region `slot`, yielding its commits."""
    runner.allocate_kv(capacity, slot)
    sent: Outputs | None = None
    while True:
        try:
            step = steps.send(sent)
        except StopIteration:
            return
        sent = None
        if isinstance(step, Forward):
            sent = runner.run(step.graph, step.input_ids, step.position_ids, step.attention_mask, step.past,
                              step.write_at, slot)
        elif isinstance(step, KVMove):
            runner.move_kv(step.src, step.dst, step.length, slot)
        else:
            yield step


def refusion_decode(runner: Runner, tokens: Tokens, params: DecodeParams, trace: DecodeTrace,
                    logits: bool) -> Iterator[Commit]:
    """ReFusion on one runner, alone (the parity tests' entry point)."""
    return run_on(runner, refusion_steps(tokens, params, trace, logits), kv_capacity(len(tokens.prompt), params))


def ar_decode(runner: Runner, tokens: Tokens, params: DecodeParams, trace: DecodeTrace,
              logits: bool) -> Iterator[Commit]:
    """Autoregressive decoding on one runner, alone."""
    return run_on(runner, ar_steps(tokens, params, trace, logits), kv_capacity(len(tokens.prompt), params))
