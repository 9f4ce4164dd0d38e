"""An EOS found in infill: upstream drops slots of R by a row index, leaving positions before the EOS never
decoded (holes); by default we drop only the slots from the EOS slot on. upstream_eos_drop=True is upstream's."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.params import DecodeParams
from refusion.runtime.request import GenerationResult
from tests.helpers import MASK_ID, decode_on

pytest.importorskip("onnxruntime")

PROMPTS = ([5, 17, 42, 99, 7], [200, 3, 3, 64, 81, 12, 150, 9, 31], [11, 12, 13], [77, 78, 79, 80, 81, 82])
LAYOUTS = ((4, 32, 2), (8, 32, 1), (8, 48, 3), (4, 64, 1), (4, 30, 2))  # (slot_size, gen_length, serial blocks)
THRESHOLDS = ((0.9, 0.4), (0.6, 0.3), (0.2, 0.7), (0.5, 0.05), (0.3, 0.02))


def has_hole(result: GenerationResult, prompt_length: int, eos: int) -> bool:
    """A position before the first EOS (or the last committed one) that was never decoded."""
    committed = {p: t for c in result.commits for p, t in zip(c.positions, c.token_ids)}
    end = min((p for p, t in committed.items() if t == eos), default=max(committed) + 1)
    return any(p not in committed for p in range(prompt_length, end))


def test_we_never_leave_a_hole_and_differ_from_upstream_only_where_it_does(peaky_export):
    from refusion.runtime.runners.onnxruntime import OrtRunner

    cases = holes = 0
    with OrtRunner(ExportManifest.load(peaky_export), threads=1) as runner:
        for prompt, (k, gen, blocks), (slot_thr, tok_thr) in itertools.product(PROMPTS, LAYOUTS, THRESHOLDS):
            params = DecodeParams(gen_length=gen, slot_size=k, serial_num_blocks=blocks, slot_threshold=slot_thr,
                                  token_threshold=tok_thr)
            drafted = decode_on(runner, Tokens(prompt, MASK_ID, -1), params).committed_ids
            for eos in sorted(set(drafted[:12])):  # tokens committed early on, each made the EOS in turn
                tokens = Tokens(prompt, MASK_ID, eos)
                ours = decode_on(runner, tokens, params)
                upstream = decode_on(runner, tokens, replace(params, upstream_eos_drop=True))
                case = f"prompt={prompt} eos={eos} {params}"
                assert not has_hole(ours, len(prompt), eos), case
                upstream_hole = has_hole(upstream, len(prompt), eos)
                assert ours.committed_ids == upstream.committed_ids or upstream_hole, case
                cases, holes = cases + 1, holes + upstream_hole
    assert holes >= 10, f"upstream's drop left a hole in only {holes} of {cases} cases: the branch is barely reached"
