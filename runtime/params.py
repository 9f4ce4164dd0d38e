"""Decode parameters, validated before any work so a bad request never touches the cache."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from numbers import Integral, Real
from typing import Any, Literal

from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import MODES, STRATEGIES

Mode = Literal["refusion", "ar"]  # decode.MODES, spelled out for type checkers


@dataclass(frozen=True)
class DecodeParams:
    gen_length: int = 512
    slot_size: int = 32
    serial_num_blocks: int = 4
    slot_threshold: float = 0.9
    token_threshold: float = 0.4
    temperature: float = 0.0
    seed: int | None = None
    mode: Mode = "refusion"
    max_tokens: int | None = None  # at most this many new tokens; None: the canvas (gen_length, padded) bounds them
    top_k: int = 0  # temperature > 0: draw among the k most likely candidates (0: all the export's K)
    top_p: float = 1.0  # ... the smallest set of them whose tempered probability reaches top_p (1: no cut)
    min_p: float = 0.0  # ... those at least min_p x the most likely one's tempered probability (0: no cut)
    upstream_eos_drop: bool = False  # ReFusion: drop slots after an EOS found in infill as upstream does (holes)

    def __post_init__(self) -> None:
        for name in ("gen_length", "slot_size", "serial_num_blocks"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise RefusionError(f"{name}={value!r} must be a positive integer.")
            object.__setattr__(self, name, int(value))  # numpy scalars become plain, JSON-safe numbers
        if self.max_tokens is not None:
            if not _is_int(self.max_tokens) or self.max_tokens <= 0:
                raise RefusionError(f"max_tokens={self.max_tokens!r} must be a positive integer (the most new tokens "
                                    "to return), or None.")
            object.__setattr__(self, "max_tokens", int(self.max_tokens))
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            if not _is_number(value):
                raise RefusionError(
                    f"{name}={value!r} must be a number in [0, 1]; it is compared against a probability.")
            if not 0.0 <= value <= 1.0:
                raise RefusionError(f"{name}={value!r} is outside [0, 1]; it is compared against a probability.")
            object.__setattr__(self, name, float(value))
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise RefusionError(
                f"temperature={self.temperature!r} must be >= 0 and finite (0 is greedy; e.g. 0.7 samples).")
        object.__setattr__(self, "temperature", float(self.temperature))
        if self.seed is not None:
            if not _is_int(self.seed) or not -2**63 <= self.seed < 2**64:
                raise RefusionError(f"seed={self.seed!r} must be None or an integer in [-2**63, 2**64) (it seeds the "
                                    "sampling noise).")
            object.__setattr__(self, "seed", int(self.seed) % 2**64)  # a negative int64 seed as its unsigned bits
        if not _is_int(self.top_k) or self.top_k < 0:
            raise RefusionError(f"top_k={self.top_k!r} must be an integer >= 0 (0: every candidate the export emits).")
        object.__setattr__(self, "top_k", int(self.top_k))
        if not _is_number(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise RefusionError(f"top_p={self.top_p!r} must be a number in [0, 1] (1: no nucleus cut; 0: the most "
                                "likely candidate alone).")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p < 1.0:
            raise RefusionError(f"min_p={self.min_p!r} must be a number in [0, 1) (0: no cut).")
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "min_p", float(self.min_p))
        if not isinstance(self.upstream_eos_drop, bool):
            raise RefusionError(f"upstream_eos_drop={self.upstream_eos_drop!r} must be True or False.")
        if self.mode not in MODES:
            raise RefusionError(f"mode={self.mode!r} is not one of {', '.join(map(repr, MODES))}.")
        STRATEGIES[self.mode].check(self)

    @staticmethod
    def with_defaults(defaults: DecodeDefaults, **settings: Any) -> DecodeParams:
        """`settings` over an export's recorded `defaults`: a decode setting left out, or None, takes the
        export's value; the others (temperature and sampling, seed, mode, max_tokens) keep the bare defaults."""
        names = [f.name for f in fields(DecodeParams)]
        unknown = [name for name in settings if name not in names]
        if unknown:
            raise RefusionError(f"unknown decode setting {unknown[0]}={settings[unknown[0]]!r}; "
                                f"the settings are {', '.join(names)}.")
        recorded = asdict(defaults)
        given = {name: value for name, value in settings.items() if value is not None or name not in recorded}
        return DecodeParams(**{**recorded, **given})

    @property
    def positions(self) -> int:
        """Positions the generation takes after the prompt (its strategy's count)."""
        return STRATEGIES[self.mode].positions(self)

    @property
    def padded_gen_length(self) -> int:
        """gen_length rounded up to whole slots, as upstream pads it."""
        k = self.slot_size
        return self.gen_length + (-self.gen_length % k)

    @property
    def block_length(self) -> int:
        gen, k, blocks = self.padded_gen_length, self.slot_size, self.serial_num_blocks
        if gen % blocks or (gen // blocks) % k:
            slots = gen // k  # the block counts that fit are the divisors of the slots: the first 64 counts tried
            fits = [b for b in range(1, min(slots, 64) + 1) if slots % b == 0]
            more = f" or another divisor of its {slots} slots" if slots > 64 else ""
            raise RefusionError(
                f"gen_length {gen} (padded to slot_size {k}) cannot be cut into serial_num_blocks={blocks} "
                f"blocks of whole slots; with these values serial_num_blocks may be one of {fits}{more}, or choose "
                f"gen_length as a multiple of slot_size x serial_num_blocks = {k * blocks}."
            )
        return gen // blocks


DECODE_SETTINGS = tuple(f.name for f in fields(DecodeParams))


def _is_int(value: object) -> bool:
    """An integer, numpy's included, but not a bool."""
    return isinstance(value, Integral) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)
