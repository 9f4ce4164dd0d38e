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
from refusion.runtime.core.fields import Fields
from refusion.runtime.core.settings import DEFAULTS, RECORDED


@dataclass(frozen=True)
class RecordedSettings:
    """The settings runtime/core/settings.py marks `recorded` (an export records them), with their defaults (the
    paper's gsm8k row): declared once, the first fields of both an export's DecodeDefaults and a request's
    DecodeParams (runtime/params.py)."""

    gen_length: int = DEFAULTS["gen_length"]
    slot_size: int = DEFAULTS["slot_size"]
    serial_num_blocks: int = DEFAULTS["serial_num_blocks"]
    slot_threshold: float = DEFAULTS["slot_threshold"]
    token_threshold: float = DEFAULTS["token_threshold"]


@dataclass(frozen=True)
class DecodeDefaults(RecordedSettings):
    """An export's recorded settings, checked by their rows and whole: gen_length in whole blocks of whole slots."""

    def __post_init__(self) -> None:
        for setting in RECORDED:
            try:
                object.__setattr__(self, setting.name, setting.check(getattr(self, setting.name)))
            except RefusionError as e:
                raise RefusionError(f"decode default {e}", e.field) from None
        if self.gen_length % (self.slot_size * self.serial_num_blocks):
            raise RefusionError(
                f"decode defaults: gen_length {self.gen_length} is not a multiple of slot_size x serial_num_blocks "
                f"= {self.slot_size * self.serial_num_blocks}.")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def read(fields: Fields, at: str) -> DecodeDefaults:
        """The settings recorded at `at` of a JSON file, each checked by its row (a bad one named as the file's
        field), then the layout."""
        values = {setting.name: fields.get(f"{at}.{setting.name}") for setting in RECORDED}
        try:
            return DecodeDefaults(**values)
        except RefusionError as e:  # name the file, the field and the fix as every field error does
            where = f"{at}.{e.field}" if e.field else at
            raise RefusionError(f"{fields.file}: field {where}: {e} {fields.fix[0].upper()}{fields.fix[1:]}.") from e

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
