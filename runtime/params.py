"""Decode parameters, validated before any work so a bad request never touches the cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from refusion.runtime.core.errors import RefusionError

Mode = Literal["refusion", "ar"]


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

    def __post_init__(self) -> None:
        for name in ("gen_length", "slot_size", "serial_num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise RefusionError(f"{name}={value!r} must be a positive integer.")
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise RefusionError(f"{name}={value!r} is outside [0, 1]; it is compared against a probability.")
        if self.temperature < 0:
            raise RefusionError(f"temperature={self.temperature!r} must be >= 0 (0 is greedy).")
        if self.mode not in ("refusion", "ar"):
            raise RefusionError(f"mode={self.mode!r} is not one of 'refusion', 'ar'.")
        if self.mode == "refusion":
            _ = self.block_length  # validates the layout

    @property
    def padded_gen_length(self) -> int:
        """gen_length rounded up to whole slots, as upstream pads it."""
        k = self.slot_size
        return self.gen_length + (-self.gen_length % k)

    @property
    def block_length(self) -> int:
        gen, k, blocks = self.padded_gen_length, self.slot_size, self.serial_num_blocks
        if gen % blocks or (gen // blocks) % k:
            fits = [b for b in range(1, gen // k + 1) if gen % b == 0 and (gen // b) % k == 0]
            raise RefusionError(
                f"gen_length {gen} (padded to slot_size {k}) cannot be cut into serial_num_blocks={blocks} "
                f"blocks of whole slots; with these values serial_num_blocks may be one of {fits}, or choose "
                f"gen_length as a multiple of slot_size x serial_num_blocks = {k * blocks}."
            )
        return gen // blocks
