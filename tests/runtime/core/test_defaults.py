"""Export decode defaults: the paper's row, clamped to the model's positions, always a valid layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.fields import Fields


@pytest.mark.parametrize("positions, expected", [
    (40960, (512, 32, 4)),  # ReFusion-8B: the paper's gsm8k row as is
    (1024, (512, 32, 4)),
    (256, (128, 32, 4)),  # half the positions, whole blocks of whole slots
    (100, (32, 32, 1)),  # one 4-slot block too long: fewer blocks first
    (40, (20, 20, 1)),  # then smaller slots
    (3, (1, 1, 1)),
])
def test_paper_row_clamped_to_half_the_positions(positions, expected):
    d = DecodeDefaults().clamped(positions)
    assert (d.gen_length, d.slot_size, d.serial_num_blocks) == expected
    assert d.gen_length <= max(1, positions // 2) and d.gen_length % (d.slot_size * d.serial_num_blocks) == 0
    assert (d.slot_threshold, d.token_threshold) == (0.9, 0.4)


def test_a_fitting_setting_is_kept():
    tiny = DecodeDefaults(64, 4, 4, 0.5, 0.1)
    assert tiny.clamped(256) == tiny


@pytest.mark.parametrize("kwargs, match", [
    ({"gen_length": 0}, r"gen_length=0 must be a positive integer"),
    ({"slot_size": True}, r"slot_size=True must be a positive integer"),
    ({"slot_threshold": 1.5}, r"decode default slot_threshold=1.5 is outside \[0, 1\]"),
    ({"gen_length": 100}, r"gen_length 100 is not a multiple of slot_size x serial_num_blocks = 128"),
])
def test_invalid_defaults_refused(kwargs, match):
    with pytest.raises(RefusionError, match=match):
        DecodeDefaults(**kwargs)


@pytest.mark.parametrize("recorded, match", [
    ({"token_threshold": 1.5}, r"^x\.json: field d\.token_threshold: decode default token_threshold=1\.5 is outside "
                               r"\[0, 1\] \(it is compared against a probability\)\. Fix it\.$"),
    ({"slot_size": "4"}, r"^x\.json: field d\.slot_size: decode default slot_size='4' must be a positive integer"),
    ({"slot_size": None}, r"^x\.json: field d\.slot_size: decode default slot_size=None must be"),
    ({"gen_length": 60}, r"^x\.json: field d: decode defaults: gen_length 60 is not a multiple of slot_size x "
                         r"serial_num_blocks = 16\. Fix it\.$"),
])
def test_recorded_defaults_are_read_by_their_rows_and_named_as_the_files_fields(recorded, match):
    good = {"gen_length": 64, "slot_size": 4, "serial_num_blocks": 4, "slot_threshold": 0.5, "token_threshold": 0.1}
    assert DecodeDefaults.read(Fields(Path("x.json"), {"d": good}, "fix it"), "d") == DecodeDefaults(64, 4, 4, 0.5, 0.1)
    with pytest.raises(RefusionError, match=match):
        DecodeDefaults.read(Fields(Path("x.json"), {"d": {**good, **recorded}}, "fix it"), "d")
    missing = {k: v for k, v in good.items() if k != "serial_num_blocks"}
    with pytest.raises(RefusionError, match=r"^x\.json: field d\.serial_num_blocks is missing; fix it\.$"):
        DecodeDefaults.read(Fields(Path("x.json"), {"d": missing}, "fix it"), "d")
