"""DecodeParams: every bad value is one RefusionError naming it; an export's defaults fill what is left out."""

from __future__ import annotations

import json

import numpy as np
import pytest

from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.params import DecodeParams
from tests.helpers import positions

TINY = DecodeDefaults(gen_length=64, slot_size=4, serial_num_blocks=4, slot_threshold=0.5, token_threshold=0.1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gen_length="64"), "gen_length='64' must be a positive integer."),
    (dict(slot_size=4.0), "slot_size=4.0 must be a positive integer."),
    (dict(serial_num_blocks=True), "serial_num_blocks=True must be a positive integer."),
    (dict(slot_threshold="x"), "slot_threshold='x' must be a number in [0, 1] (it is compared against a probability)."),
    (dict(token_threshold=None), "token_threshold=None must be a number in [0, 1]"),
    (dict(slot_threshold=float("nan")), "slot_threshold=nan must be a number in [0, 1]"),
    (dict(temperature=None), "temperature=None must be >= 0 and finite (0 is greedy; e.g. 0.7 samples)."),
    (dict(temperature=float("nan")), "temperature=nan must be >= 0 and finite"),
    (dict(temperature=float("inf")), "temperature=inf must be >= 0 and finite"),
    (dict(temperature="0.7"), "temperature='0.7' must be >= 0 and finite"),
    (dict(seed="a"), "seed='a' must be an integer in [-2**63, 2**64), or None (it seeds the sampling noise)."),
    (dict(seed=2**64), f"seed={2**64} must be an integer in [-2**63, 2**64), or None"),
    (dict(top_p=1.5), "top_p=1.5 is outside [0, 1]"),
    (dict(upstream_eos_drop=1), "upstream_eos_drop=1 must be True or False."),
    (dict(mode=3), "mode=3 is not one of 'refusion', 'ar'."),
    (dict(max_tokens=0), "max_tokens=0 must be a positive integer, or None (the most new tokens to return)."),
    (dict(max_tokens=2.5), "max_tokens=2.5 must be a positive integer"),
])
def test_wrong_types_and_non_finite_values_are_refused_by_name(kwargs, message):
    with pytest.raises(RefusionError) as err:
        DecodeParams(**kwargs)
    assert message in str(err.value)


def test_a_negative_seed_is_an_int64_taken_as_its_unsigned_bits():
    assert DecodeParams(seed=-1).seed == 2**64 - 1 and DecodeParams(seed=-(2**63)).seed == 2**63
    assert DecodeParams(seed=5).seed == 5


def test_numpy_scalars_are_accepted_as_plain_numbers():
    p = DecodeParams(gen_length=np.int64(64), slot_size=np.int32(4), serial_num_blocks=np.int64(2),
                     slot_threshold=np.float32(0.5), token_threshold=np.float64(0.25), temperature=np.float32(0))
    json.dumps({"gen_length": p.gen_length, "slot_threshold": p.slot_threshold, "temperature": p.temperature})
    assert (p.gen_length, p.slot_threshold, p.token_threshold) == (64, 0.5, 0.25)


def test_ar_mode_takes_gen_length_unpadded_and_no_block_layout():
    ar = DecodeParams(gen_length=30, slot_size=7, serial_num_blocks=3, mode="ar")
    assert positions(ar) == 30
    assert positions(DecodeParams(gen_length=30, slot_size=4, serial_num_blocks=2)) == 32  # ReFusion: whole slots
    with pytest.raises(RefusionError, match="serial_num_blocks may be one of"):
        DecodeParams(gen_length=30, slot_size=7, serial_num_blocks=3)


def test_settings_left_out_or_none_take_the_exports_defaults():
    assert DecodeParams.with_defaults(TINY) == DecodeParams(64, 4, 4, 0.5, 0.1)
    p = DecodeParams.with_defaults(TINY, gen_length=32, slot_size=None, temperature=0.5, seed=3, mode="ar")
    assert p == DecodeParams(32, 4, 4, 0.5, 0.1, temperature=0.5, seed=3, mode="ar")
    with pytest.raises(RefusionError, match="temperature=None must be >= 0"):  # None is a default only where one is recorded
        DecodeParams.with_defaults(TINY, temperature=None)


def test_an_unknown_setting_lists_the_valid_ones():
    with pytest.raises(RefusionError) as err:
        DecodeParams.with_defaults(TINY, unknown_setting=1)
    assert str(err.value) == ("unknown decode setting unknown_setting=1; the settings are gen_length, slot_size, "
                              "serial_num_blocks, slot_threshold, token_threshold, temperature, seed, mode, max_tokens, top_k, top_p, min_p, "
                              "upstream_eos_drop.")


def test_max_tokens_is_kept_apart_from_the_exports_canvas():
    p = DecodeParams.with_defaults(TINY, max_tokens=10)
    assert (p.max_tokens, p.gen_length) == (10, 64)  # gen_length still sets ReFusion's block length
    assert positions(p) == 16  # the whole block of 16 that covers 10 tokens
    assert positions(DecodeParams.with_defaults(TINY, max_tokens=10, mode="ar")) == 10
    assert DecodeParams.with_defaults(TINY).max_tokens is None
