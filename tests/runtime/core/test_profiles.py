"""Profiles from decode limits, over the paper's settings table (docs/decoding.md)."""

from __future__ import annotations

import pytest

from refusion.runtime.core.contract import graph_specs
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.profiles import (
    DecodeLimits,
    ProfileSpec,
    box_profile,
    check_request,
    engine_profiles,
    forward_boxes,
    select_profile,
)

# task: (slot_size, serial_num_blocks), gen_length 512 (upstream eval.sh), and the generate.py demo
PAPER = {
    "gsm8k_cot": (32, 4), "minerva_math": (32, 8), "gpqa": (8, 32), "mbpp": (32, 4),
    "humaneval": (32, 4), "arc_challenge": (8, 64), "mmlu_pro": (16, 4), "demo": (4, 32),
}
PROMPTS = (1, 37, 1000, 2048)


def _covered(limits: DecodeLimits, prompt: int, gen: int, k: int, blocks: int) -> None:
    profiles = engine_profiles(limits)
    padded = gen + (-gen % k)
    for box in forward_boxes(prompt, padded, padded // blocks):
        index = box_profile(profiles, box)
        assert index is not None and profiles[index].graph == box.graph, (limits, prompt, box)


@pytest.mark.parametrize("task", PAPER)
def test_each_setting_is_served_by_engines_built_for_it(task):
    k, blocks = PAPER[task]
    limits = DecodeLimits(slot_size=k, serial_blocks=blocks)
    for prompt in PROMPTS:
        check_request(limits, prompt, 512, k, blocks)
        _covered(limits, prompt, 512, k, blocks)


@pytest.mark.parametrize("task", PAPER)
def test_default_engines_serve_the_whole_table(task):
    """The default limits (gsm8k's 32 x 4) have the longest block of the table: one build serves all."""
    k, blocks = PAPER[task]
    for prompt in PROMPTS:
        check_request(DecodeLimits(), prompt, 512, k, blocks)
        _covered(DecodeLimits(), prompt, 512, k, blocks)
        check_request(DecodeLimits(), prompt, 100, k, blocks)  # shorter generations fit too


def test_profile_layout_and_opt_shapes():
    """One engine serves both roles: the infiller's prefill and decode profiles, and the planner's decode
    profile ("plan"), whose opt is a whole block."""
    limits = DecodeLimits()  # P 2048, G 512, k 32, block 128
    prefill, decode, plan = engine_profiles(limits)
    assert [(p.name, p.graph) for p in (prefill, decode, plan)] == [
        ("prefill", "infiller"), ("decode", "infiller"), ("plan", "planner")]
    assert prefill.seq == (1, 1024 + 128, 2048 + 128) and prefill.past == (0, 0, 0)
    assert decode.seq == (1, 32, 128) and decode.past == (0, 1024 + 256, 2048 + 512 + 128)
    assert plan.seq == (1, 128, 128) and plan.past == decode.past
    for p in (prefill, decode, plan):
        assert p.seq[0] <= p.seq[1] <= p.seq[2] and p.past[0] <= p.past[1] <= p.past[2]
    # the deepest past a forward may read is the whole KV cache the loop allocates at the limits
    assert decode.past[2] == plan.past[2] == limits.kv_capacity


def test_select_profile_picks_by_role_and_prefers_prefill_without_past():
    profiles = engine_profiles(DecodeLimits())
    assert select_profile(profiles, "infiller", 2000, 0) == 0
    assert select_profile(profiles, "infiller", 1, 0) == 0
    assert select_profile(profiles, "infiller", 32, 1500) == 1
    assert select_profile(profiles, "infiller", 129, 1500) is None
    assert select_profile(profiles, "infiller", 3000, 0) is None
    assert select_profile(profiles, "planner", 128, 1500) == 2  # the decode profile holds it too: the role decides
    assert select_profile(profiles, "planner", 1, 0) == 2
    assert select_profile(profiles, "planner", 129, 1500) is None
    assert select_profile(profiles, "planner", 129, 0) is None  # the prefill profile holds it, not the role


def test_profiles_compute_at_most_a_block_of_heads():
    """A prefill reads its block of masks (or AR's one token), never its prompt's positions: the engine's
    vocabulary head is sized for a block whatever the prompt."""
    profiles = engine_profiles(DecodeLimits())
    assert [p.head_range for p in profiles] == [(1, 128, 128), (1, 32, 128), (1, 128, 128)]
    assert select_profile(profiles, "infiller", 2000, 0, heads=128) == 0
    assert select_profile(profiles, "infiller", 2000, 0, heads=129) is None
    assert profiles[0].shapes(graph_specs(2, 2, 8, 50, "float16", False)["infiller"])["head_positions"] == (
        (1, 1), (1, 128), (1, 128))
    assert ProfileSpec.from_json(profiles[0].to_json()) == profiles[0]
    old = {k: v for k, v in profiles[0].to_json().items() if k != "heads"}  # an engine built before head positions
    assert ProfileSpec.from_json(old).head_range == (1, 1024 + 128, 2048 + 128)


def test_profiles_round_trip_with_their_role():
    for profile in engine_profiles(DecodeLimits()):
        assert ProfileSpec.from_json(profile.to_json()) == profile
    with pytest.raises(ValueError, match="graph 'drafter'"):
        ProfileSpec.from_json({**engine_profiles(DecodeLimits())[2].to_json(), "graph": "drafter"})


def test_shapes_follow_the_contract_axes():
    spec = graph_specs(2, 8, 128, 1000, "float16", logits=False)["infiller"]
    shapes = ProfileSpec("decode", "infiller", (1, 32, 128), (0, 1280, 2688)).shapes(spec)
    assert shapes["input_ids"] == ((1, 1), (1, 32), (1, 128))
    assert shapes["attention_mask"] == ((1, 1, 1), (1, 32, 1312), (1, 128, 2816))
    assert shapes["past_key_values.1.value"] == ((1, 0, 8, 128), (1, 1280, 8, 128), (1, 2688, 8, 128))
    assert set(shapes) == {t.name for t in spec.inputs}


def test_limits_round_trip_and_flags():
    limits = DecodeLimits(max_prompt=100, gen_length=60, slot_size=8, serial_blocks=2, max_slots=6)
    assert limits.gen_length == 64  # padded to whole slots, as the loop pads
    assert DecodeLimits.from_json(limits.to_json()) == limits
    assert "--max-slots 6" in limits.flags() and limits.block_length == 48


@pytest.mark.parametrize("kwargs, flag", [
    (dict(max_prompt=0), "--max-prompt"),
    (dict(gen_length=512, slot_size=32, serial_blocks=3), "--serial-num-blocks 3"),
    (dict(max_slots=2), "--max-slots 2"),  # fewer than the 4 slots of a default block
    (dict(max_slots=17), "--max-slots 17"),  # a block longer than the generation
])
def test_bad_limits_name_the_flag(kwargs, flag):
    with pytest.raises(RefusionError, match=flag):
        DecodeLimits(**kwargs)


def test_requests_outside_the_limits_name_the_limit_and_the_flag():
    limits = DecodeLimits()
    with pytest.raises(RefusionError, match=r"2049 tokens.*--max-prompt 2048.*--max-prompt 4096"):
        check_request(limits, 2049, 512, 32, 4)
    with pytest.raises(RefusionError, match=r"gen_length 1024.*--gen-length 1024`"):
        check_request(limits, 10, 1024, 32, 8)
    with pytest.raises(RefusionError, match=r"block of 256 tokens.*serial_num_blocks >= 4.*--max-slots 8`"):
        check_request(limits, 10, 512, 32, 2)
    check_request(DecodeLimits(max_slots=8), 10, 512, 32, 2)  # which the flag then allows


def test_a_prefill_bound_makes_the_prefill_profile_chunks_over_a_past():
    """Issue 34: --prefill-chunk C (at least a block): the prefill profile takes 1..C tokens over a past of up to
    max_prompt + a block, every request's prefill box fits it, and engines.json keeps the bound."""
    limits = DecodeLimits(max_prompt=512, gen_length=256, slot_size=16, serial_blocks=4, prefill_chunk=128)
    prefill = engine_profiles(limits)[0]
    assert (prefill.seq, prefill.past) == ((1, 128, 128), (0, 256, 512 + 64 - 1))
    check_request(limits, 500, 256, 16, 4)  # its boxes fit the profiles (asserted inside)
    boxes = {box.kind: box for box in forward_boxes(500, 256, 64, 128)}
    assert (boxes["prefill_plan"].seq, boxes["prefill_plan"].past) == ((1, 128), (0, 563))
    assert (boxes["ar_prefill"].seq, boxes["ar_prefill"].past) == ((1, 128), (0, 499))
    assert forward_boxes(40, 256, 64, 128)[0].seq == (104, 104)  # within one chunk: whole, as before
    assert DecodeLimits.from_json(limits.to_json()) == limits and "--prefill-chunk 128" in limits.flags()
    assert DecodeLimits.from_json({k: v for k, v in limits.to_json().items() if k != "prefill_chunk"}).prefill_chunk is None
    # no bound is a flag too: a rebuild command without one would build for the default bound (issue 43)
    assert "--prefill-chunk 0" in DecodeLimits().flags()
    with pytest.raises(RefusionError, match=r"--prefill-chunk 32 must be an integer of at least the engines' block of 64"):
        DecodeLimits(max_prompt=512, gen_length=256, slot_size=16, serial_blocks=4, prefill_chunk=32)


def test_a_bound_past_the_longest_prefill_sizes_the_prefill_profile_for_that_prefill():
    """Issue 43: builds bound prefills at 256 by default; where a whole prefill is shorter (the embedded model's 192 +
    16 tokens), a chunk never feeds more than it: the profile's activations are a whole prefill's, over a past."""
    limits = DecodeLimits(192, 64, 4, 4).with_prefill_chunk(None)
    prefill = engine_profiles(limits)[0]
    assert limits.prefill_chunk == 256 and (prefill.seq, prefill.past) == ((1, 112, 208), (0, 96, 207))
    check_request(limits, 192, 64, 4, 4)  # its boxes fit the profiles (asserted inside)
    assert DecodeLimits(max_slots=16).with_prefill_chunk(None).prefill_chunk == 512  # the block, where longer
    assert DecodeLimits().with_prefill_chunk(0).prefill_chunk is None
    assert engine_profiles(DecodeLimits().with_prefill_chunk(None))[0].seq == (1, 256, 256)
