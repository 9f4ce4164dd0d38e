"""Decode parameters, validated before any work so a bad request never touches the cache."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from refusion.runtime.core.defaults import DecodeDefaults, RecordedSettings
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import DECODE, DEFAULTS, Mode, read_by


@dataclass(frozen=True)
class DecodeParams(RecordedSettings):
    """The decode settings of a request: the `decode` rows of runtime/core/settings.py, each checked there (the
    recorded ones first, declared in RecordedSettings)."""

    temperature: float = DEFAULTS["temperature"]
    seed: int | None = DEFAULTS["seed"]
    mode: Mode = DEFAULTS["mode"]
    max_tokens: int | None = DEFAULTS["max_tokens"]
    top_k: int = DEFAULTS["top_k"]
    top_p: float = DEFAULTS["top_p"]
    min_p: float = DEFAULTS["min_p"]
    upstream_eos_drop: bool = DEFAULTS["upstream_eos_drop"]

    def __post_init__(self) -> None:
        for setting in DECODE:
            object.__setattr__(self, setting.name, setting.check(getattr(self, setting.name)))
        if self.seed is not None:
            object.__setattr__(self, "seed", self.seed % 2**64)  # a negative int64 seed as its unsigned bits
        if "serial_num_blocks" in read_by(self.mode):  # a strategy that decodes blocks: the canvas must cut into them
            _ = self.block_length  # raises, naming the block counts that fit

    @staticmethod
    def with_defaults(defaults: DecodeDefaults, **settings: Any) -> DecodeParams:
        """`settings` over an export's recorded `defaults`: a decode setting left out, or None, takes the
        export's value; the others (temperature and sampling, seed, mode, max_tokens) keep the bare defaults."""
        names = [f.name for f in fields(DecodeParams)]
        unknown = [name for name in settings if name not in names]
        if unknown:
            raise RefusionError(f"unknown decode setting {unknown[0]}={settings[unknown[0]]!r}; "
                                f"the settings are {', '.join(names)}.")
        recorded = {f.name: getattr(defaults, f.name) for f in fields(defaults)}  # numbers: asdict deep-copies, 5x the time
        given = {name: value for name, value in settings.items() if value is not None or name not in recorded}
        return DecodeParams(**{**recorded, **given})

    def sized(self, positions: int, room: int, shrink: bool = True) -> DecodeParams:
        """These settings for a prompt that leaves `room` positions of the model's: where the canvas the settings
        ask for (`positions`, their strategy's count) runs past them and may be cut, the same settings with the canvas cut to the room
        (SizedParams); else these (Generator.check_fits refuses what does not fit). It may be cut when max_tokens
        is given and at most the room (any N that fits is taken), or when max_tokens is left out and `shrink`
        (gen_length is the export's, not the caller's: an answer may use what the context leaves). Cut, the
        canvas keeps its blocks of `block_length` while they fit and ends at the room (docs/decoding.md); it is
        cut to the room, not to max_tokens, so that a capped answer is still the uncapped one's first tokens."""
        if positions <= room or room < 1:
            return self
        if (self.max_tokens is None and not shrink) or (self.max_tokens is not None and self.max_tokens > room):
            return self
        return SizedParams(**{f.name: getattr(self, f.name) for f in fields(DecodeParams)}, canvas=room)

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
                f"gen_length as a multiple of slot_size x serial_num_blocks = {k * blocks}.", "gen_length")
        return gen // blocks


@dataclass(frozen=True)
class SizedParams(DecodeParams):
    """DecodeParams with the canvas sized to one prompt (DecodeParams.sized): `canvas` positions after it, which
    the strategies take as their count. Not a setting: the Generator makes it from the prompt's length."""

    canvas: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.canvas, bool) or not isinstance(self.canvas, int) or self.canvas < 1:
            raise RefusionError(f"canvas={self.canvas!r} must be a positive number of positions.")


DECODE_SETTINGS = tuple(f.name for f in fields(DecodeParams))
