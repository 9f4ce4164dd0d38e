"""The runtime's ReFusion loop equals an independent PyTorch reference of upstream, token for token."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners.onnxruntime import OrtRunner
from refusion.tools.bench.reference import ar_generate, refusion_generate
from tests.helpers import MASK_ID, decode_on, export_peaky
from tests.tiny_models import frequent_tokens

BRANCHES = ("commit_from_verification", "infill_loop", "eos_in_verification", "eos_in_infill", "fallback_single_slot")
PROMPTS = ([5, 17, 42, 99, 7], [200, 3, 3, 64, 81, 12, 150, 9, 31])
# (slot_size, gen_length, serial blocks)
LAYOUTS = ((4, 32, 2), (8, 32, 1), (8, 48, 3), (32, 64, 2), (4, 30, 2))
THRESHOLDS = ((0.9, 0.4), (0.6, 0.3), (0.2, 0.7), (0.0, 0.0))


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    out = []
    for seed in (0, 1):
        model, export = export_peaky(tmp, seed)
        runner = OrtRunner(ExportManifest.load(export), threads=1)
        runner.activate()
        out.append((model, runner))
    yield out
    for _, runner in out:
        runner.deactivate()


def _collect(runner, prompt, eos, params):
    """Every token we committed (position order) and the stats, the request driven by the scheduler alone on
    `runner`."""
    result = decode_on(runner, Tokens(prompt, MASK_ID, eos), params)
    return result.committed_ids, result.stats


def test_refusion_matches_reference_over_grid(setups):
    branches: Counter = Counter()
    grid = list(itertools.product(LAYOUTS, THRESHOLDS, range(2)))
    for i, ((k, gen, blocks), (slot_thr, tok_thr), variant) in enumerate(grid):
        model, runner = setups[(i + variant) % len(setups)]
        prompt = PROMPTS[variant]
        frequent = frequent_tokens(model, prompt)
        # EOS: the most drafted token (reached early), a rarer one (late), or none (never reached)
        eos = (frequent[0], frequent[min(3, len(frequent) - 1)], -1)[(i + 2 * variant) % 3]
        params = DecodeParams(gen_length=gen, slot_size=k, serial_num_blocks=blocks,
                              slot_threshold=slot_thr, token_threshold=tok_thr, upstream_eos_drop=True)
        ours, stats = _collect(runner, prompt, eos, params)
        ref = refusion_generate(model, prompt, gen_length=gen, slot_size=k, serial_num_blocks=blocks,
                                slot_threshold=slot_thr, token_threshold=tok_thr, mask_id=MASK_ID, eos_id=eos)
        case = f"prompt={prompt} eos={eos} k={k} gen={gen} blocks={blocks} thr={slot_thr}/{tok_thr}"
        assert ours == ref.token_ids, case
        assert stats.tpf == pytest.approx(ref.tpf), case
        assert stats.branches == {b: c for b, c in ref.branches.items() if c}, case
        assert stats.forwards == {f: c for f, c in ref.forwards.items() if c}, case
        branches.update(stats.branches)
    never = [b for b in BRANCHES if branches[b] == 0]
    assert not never, f"branches never exercised over {len(grid)} cases: {never}"
    print(f"{len(grid)} cases, branches: {dict(branches)}")


def test_ar_matches_reference(setups):
    for (model, runner), prompt in itertools.product(setups, PROMPTS):
        eos = frequent_tokens(model, prompt)[2]
        ours, stats = _collect(runner, prompt, eos, DecodeParams(gen_length=24, mode="ar"))
        assert ours == ar_generate(model, prompt, max_new_tokens=24, eos_id=eos)
        assert stats.forwards["prefill"] == 1 and stats.forwards["decode"] == len(ours) - 1
