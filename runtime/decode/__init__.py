"""The decode strategies, each a step machine (decode/steps.py), behind one table: all the rest of the
runtime asks of a mode (the Generator, the shapes a backend is asked to check) it asks of `STRATEGIES`, so a
new strategy is a module here and a row below; the settings table (runtime/core/settings.py) names the public
modes and the settings each one's steps read, which DecodeParams checks by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import read_by
from refusion.runtime.decode import ar, guided, llada, refusion
from refusion.runtime.decode.steps import DecodeTrace, StepMachine, Tokens

Steps = Callable[[Tokens, Any, DecodeTrace], StepMachine]  # (tokens, params, trace)


@dataclass(frozen=True)
class Strategy:
    steps: Steps
    settings: tuple[str, ...]  # the params its steps read (runtime/core/settings.py's rows that name it)
    kv_capacity: Callable[[int, Any], int]  # KV tokens a request needs, from its prompt length
    positions: Callable[[Any], int]  # positions the generation takes after the prompt
    # TensorRT: (gen_length, slot size, serial blocks) the engines' limits must hold; None: no profile takes
    # its forwards
    profile_needs: Callable[[Any], tuple[int, int, int]] | None
    prefix_reuse: bool = True  # its steps start from Tokens.cached (a cached prompt prefix's KV in the region)
    guided: Steps | None = None  # its steps when the request brings a guide (Tokens.guide); None: it takes none


def _guided(module: Any, drafting: bool) -> Steps:
    """The guided loop (decode/guided.py) over a strategy's positions and KV capacity."""
    def steps(tokens: Tokens, params: Any, trace: DecodeTrace) -> StepMachine:
        return guided.guided_steps(tokens, params, trace, module.positions(params),
                                   module.kv_capacity(len(tokens.prompt), params), drafting)
    return steps


STRATEGIES: dict[str, Strategy] = {
    "refusion": Strategy(refusion.refusion_steps, read_by("refusion"), refusion.kv_capacity, refusion.positions,
                         refusion.profile_needs, guided=_guided(refusion, drafting=True)),
    "ar": Strategy(ar.ar_steps, read_by("ar"), ar.kv_capacity, ar.positions, ar.profile_needs,
                   guided=_guided(ar, drafting=False)),
    # the benchmark's baseline, with its own params (llada.DiffusionParams): not one of the settings' MODES
    "llada": Strategy(llada.llada_steps, ("gen_length", "steps", "block_length", "order", "early_exit"),
                      llada.kv_capacity, llada.positions, None, prefix_reuse=False),
}


def strategy(mode: str) -> Strategy:
    if mode not in STRATEGIES:
        raise RefusionError(f"mode={mode!r} is not one of {', '.join(map(repr, STRATEGIES))}.", "mode")
    return STRATEGIES[mode]


def profile_needs(params: Any) -> tuple[int, int, int] | None:
    """What a request of `params` needs of TensorRT engines' limits (Runner.check_request): its strategy's
    (gen_length, slot size, serial blocks), or None where no engine profile takes its forwards."""
    needs = strategy(params.mode).profile_needs
    return needs(params) if needs is not None else None
