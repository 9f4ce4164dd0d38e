"""The decode settings an export records as its defaults, so generation works with no flags.

A checkpoint may carry its own (the embedded model's are the ones it was trained and
benchmarked at: `refusion_decode` in its generation_config.json); otherwise the paper's
gsm8k row applies (docs/decoding.md has the whole table). Either is clamped so that
generation leaves at least half the model's positions to the prompt.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.fields import Fields, is_int


@dataclass(frozen=True)
class DecodeDefaults:
    gen_length: int = 512
    slot_size: int = 32
    serial_num_blocks: int = 4
    slot_threshold: float = 0.9
    token_threshold: float = 0.4

    def __post_init__(self) -> None:
        for name in ("gen_length", "slot_size", "serial_num_blocks"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise RefusionError(f"decode default {name}={value!r} must be a positive integer.")
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise RefusionError(f"decode default {name}={value!r} must be a number in [0, 1].")
        if self.gen_length % (self.slot_size * self.serial_num_blocks):
            raise RefusionError(
                f"decode defaults: gen_length {self.gen_length} is not a multiple of slot_size x serial_num_blocks "
                f"= {self.slot_size * self.serial_num_blocks}.")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def read(fields: Fields, at: str) -> DecodeDefaults:
        values = dict(
            gen_length=fields.positive_int(f"{at}.gen_length"),
            slot_size=fields.positive_int(f"{at}.slot_size"),
            serial_num_blocks=fields.positive_int(f"{at}.serial_num_blocks"),
            slot_threshold=fields.float(f"{at}.slot_threshold", 0.0, 1.0),
            token_threshold=fields.float(f"{at}.token_threshold", 0.0, 1.0),
        )
        try:
            return DecodeDefaults(**values)
        except RefusionError as e:  # the layout: name the file and the fix as every field error does
            raise RefusionError(f"{fields.file}: field {at}: {e} {fields.fix[0].upper()}{fields.fix[1:]}.") from e

    def clamped(self, max_positions: int) -> DecodeDefaults:
        """These settings with gen_length cut to at most half of max_positions (whole blocks of
        whole slots); fewer blocks, then smaller slots, when even one block is too long."""
        budget = max_positions // 2
        slot, blocks = self.slot_size, self.serial_num_blocks
        while slot * blocks > budget and blocks > 1:
            blocks //= 2
        slot = max(1, min(slot, budget // blocks))
        unit = slot * blocks
        gen = max(unit, min(self.gen_length, budget) // unit * unit)
        return DecodeDefaults(gen, slot, blocks, self.slot_threshold, self.token_threshold)
