"""The strategy table is the one place a mode is looked up: what each declares, who asks it, and no
branching on a mode's name anywhere else in the product."""

from __future__ import annotations

import ast
from dataclasses import replace

import pytest

from refusion.runtime import DecodeParams, RefusionError
from refusion.runtime.core.settings import DECODE, MODES
from refusion.runtime.decode import STRATEGIES, refusion, strategy
from refusion.runtime.decode.llada import DiffusionParams
from refusion.runtime.params import DECODE_SETTINGS, SizedParams
from tests.helpers import REPO, positions

PACKAGES = ("runtime", "export", "engines", "serve", "tools")


def sized(params: DecodeParams, room: int, shrink: bool = True) -> DecodeParams:
    return params.sized(positions(params), room, shrink)


def test_each_strategy_declares_its_needs():
    refusion = DecodeParams(gen_length=30, slot_size=4, serial_num_blocks=2)  # padded to 32: blocks of 16
    ar = DecodeParams(gen_length=30, mode="ar")
    llada = DiffusionParams(gen_length=32, steps=32, block_length=16)
    assert MODES == ("refusion", "ar") and set(STRATEGIES) == {"refusion", "ar", "llada"}
    assert STRATEGIES["refusion"].kv_capacity(10, refusion) == 10 + 32 + 16  # prompt, whole slots, a block of scratch
    assert STRATEGIES["ar"].kv_capacity(10, ar) == 40
    assert STRATEGIES["llada"].kv_capacity(10, llada) == 1  # no KV kept
    assert (positions(refusion), positions(ar), STRATEGIES["llada"].positions(llada)) == (32, 30, 32)
    assert STRATEGIES["refusion"].profile_needs(refusion) == (32, 4, 2)
    assert STRATEGIES["ar"].profile_needs(ar) == (30, 1, 30)  # one token a forward
    assert STRATEGIES["llada"].profile_needs is None
    assert "slot_size" in STRATEGIES["refusion"].settings and "slot_size" not in STRATEGIES["ar"].settings


@pytest.mark.parametrize("max_tokens, blocks", [
    (None, 2),  # upstream: serial_num_blocks equal blocks of gen_length
    (1, 1), (10, 1), (16, 1), (17, 2), (40, 3), (100, 7),
])
def test_max_tokens_decodes_whole_blocks_of_the_canvas_length_that_cover_it(max_tokens, blocks):
    params = DecodeParams(gen_length=32, slot_size=4, serial_num_blocks=2, max_tokens=max_tokens)
    assert refusion.block_count(params) == blocks
    assert positions(params) == 16 * blocks
    assert STRATEGIES["refusion"].kv_capacity(10, params) == 10 + 16 * blocks + 16
    assert STRATEGIES["refusion"].profile_needs(params) == (16 * blocks, 4, blocks)


@pytest.mark.parametrize("room, blocks", [
    (40, [(0, 16, 4), (16, 16, 4), (32, 8, 4)]),  # the last block cut to its whole slots that fit
    (42, [(0, 16, 4), (16, 16, 4), (32, 8, 4), (40, 2, 2)]),  # ... then the slot the room ends in, cut
    (18, [(0, 16, 4), (16, 2, 2)]),
    (3, [(0, 3, 3)]),  # less than a slot: one slot of what is left
])
def test_a_canvas_cut_to_the_room_keeps_its_blocks_and_ends_there(room, blocks):
    """clients-5, failure 5: where the canvas runs past what the context leaves, its blocks of gen_length /
    serial_num_blocks stay while they fit and the last is cut to the room, in whole slots but the last."""
    for max_tokens in (None, room):
        params = sized(DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4, max_tokens=max_tokens), room)
        assert isinstance(params, SizedParams) and params.canvas == room  # the room, not max_tokens: a cap only cuts
        assert refusion.layout(params) == blocks and positions(params) == room
        assert all(length % k == 0 and (k == 4 or (length, k) == blocks[-1][1:]) for _, length, k in blocks)
        assert STRATEGIES["refusion"].kv_capacity(10, params) == 10 + room + 16  # a block of scratch, as before
        assert STRATEGIES["refusion"].profile_needs(params) == (16 * -(-room // 16), 4, -(-room // 16))  # whole blocks
    whole = DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4)
    assert refusion.layout(whole) == [(16 * b, 16, 4) for b in range(4)]  # upstream's, as it was


def test_a_canvas_is_cut_only_where_it_runs_past_the_room_and_may_be():
    refusion_ = DecodeParams(gen_length=64, slot_size=4, serial_num_blocks=4)
    ar = DecodeParams(gen_length=64, mode="ar")
    for params in (refusion_, ar, replace(refusion_, max_tokens=40), replace(ar, max_tokens=40)):
        assert sized(params, 64) is params and sized(params, 100) is params  # it fits: as the settings ask
        assert sized(params, 0) is params  # no room at all: refused (check_fits)
    assert sized(refusion_, 40, shrink=False) is refusion_  # a gen_length given is kept: refused where it runs past
    assert sized(replace(refusion_, max_tokens=41), 40) == replace(refusion_, max_tokens=41)  # over the room: refused
    assert positions(sized(replace(refusion_, max_tokens=40), 40, shrink=False)) == 40  # max_tokens is taken
    assert positions(sized(ar, 40)) == 40 and positions(sized(replace(ar, max_tokens=30), 40)) == 30  # AR: its count
    assert positions(sized(replace(refusion_, max_tokens=20), 40)) == 32  # 2 whole blocks fit: upstream's layout
    assert DECODE_SETTINGS == tuple(s.name for s in DECODE)  # the canvas is not a setting
    with pytest.raises(RefusionError, match="canvas=0 must be a positive number of positions"):
        SizedParams(canvas=0)


def test_a_huge_max_tokens_or_gen_length_is_sized_by_arithmetic_not_by_a_list():
    """Probe 4's O16 / O17: what a request's length asks is computed in O(its digits), before any work."""
    huge = DecodeParams(gen_length=32, slot_size=4, serial_num_blocks=2, max_tokens=10**30)
    assert positions(huge) == -(-10**30 // 16) * 16 and STRATEGIES["refusion"].profile_needs(huge)[2] == -(-10**30 // 16)
    with pytest.raises(RefusionError, match=r"may be one of \[1(, \d+)*\] or another divisor of its 250000000001 slots"):
        DecodeParams(gen_length=10**12 + 4, slot_size=4, serial_num_blocks=3)


def test_decode_params_take_the_public_modes_only():
    with pytest.raises(RefusionError, match=r"mode='llada' is not one of 'refusion', 'ar'"):
        DecodeParams(mode="llada")
    with pytest.raises(RefusionError, match="cannot be cut into serial_num_blocks=3"):  # refusion's own check
        DecodeParams(gen_length=32, slot_size=4, serial_num_blocks=3)
    DecodeParams(gen_length=32, slot_size=4, serial_num_blocks=3, mode="ar")  # AR reads no blocks
    with pytest.raises(RefusionError, match="mode='fast' is not one of 'refusion', 'ar', 'llada'"):
        strategy("fast")


def test_the_clis_offer_the_tables_modes():
    from refusion.tools.bench.concurrency import bench_concurrency
    from refusion.tools.run_cli import cli

    for command in (cli.commands["generate"], cli.commands["chat"], bench_concurrency):
        mode = next(p for p in command.params if p.name == "mode")
        assert tuple(mode.type.choices) == MODES


def _mode_comparisons(tree: ast.AST) -> list[int]:
    """Lines that compare something named `mode` with a string: a branch on a strategy's name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = any((isinstance(o, ast.Name) and o.id == "mode") or (isinstance(o, ast.Attribute) and o.attr == "mode")
                        or (isinstance(o, ast.Subscript) and isinstance(o.slice, ast.Constant) and o.slice.value == "mode")
                        for o in operands)
            if named and any(_names_a_mode(o) for o in operands):
                lines.append(node.lineno)
    return lines


def _names_a_mode(node: ast.AST) -> bool:
    """A string, or a tuple, list or set of them."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_mode(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_no_code_branches_on_a_modes_name():
    found = [f"{file.relative_to(REPO)}:{line}" for package in PACKAGES for file in sorted((REPO / package).rglob("*.py"))
             for line in _mode_comparisons(ast.parse(file.read_text()))]
    assert not found, "branches on a mode's name outside decode.STRATEGIES: " + ", ".join(found)
