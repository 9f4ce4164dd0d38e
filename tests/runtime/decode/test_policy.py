"""Decode policy and masks, without any model."""

from __future__ import annotations

import numpy as np
import pytest

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.decode import masks, policy
from refusion.runtime.params import DecodeParams


def test_choose_slots_above_threshold_in_position_order():
    chosen, fell_back = policy.choose_slots(np.array([0.95, 0.2, 0.91, 0.99]), 0.9)
    assert chosen.tolist() == [0, 2, 3] and not fell_back


def test_choose_slots_falls_back_to_single_most_confident():
    chosen, fell_back = policy.choose_slots(np.array([0.3, 0.5, 0.4]), 0.9)
    assert chosen.tolist() == [1] and fell_back


def test_verification_first_token_of_each_slot_accepted_and_prefix_is_global():
    probs = np.array([[0.0, 0.9, 0.9, 0.1], [0.0, 0.9, 0.9, 0.9]])
    tags, prefix = policy.verification_tags(probs, 0.5)
    assert tags.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert prefix == 3  # stops at the first rejected token of the concatenation


def test_verification_full_acceptance_covers_all_slots():
    tags, prefix = policy.verification_tags(np.full((3, 4), 0.8), 0.5)
    assert prefix == 12 and tags.all()


def test_infill_tags_gain_at_least_one_token_per_pass():
    previous = np.array([[1, 1, 0, 0], [1, 0, 0, 0]])
    probs = np.zeros((2, 4))
    assert policy.infill_tags(previous, probs, 0.5).tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]


def test_infill_tags_accept_confident_tokens_only_after_an_accepted_prefix():
    previous = np.array([[1, 0, 0, 0]])
    probs = np.array([[0.0, 0.1, 0.9, 0.9]])
    # token 1 is accepted (its predecessor was), 2 and 3 clear the threshold after it
    assert policy.infill_tags(previous, probs, 0.5).tolist() == [[1, 1, 1, 1]]
    probs = np.array([[0.0, 0.1, 0.1, 0.9]])
    assert policy.infill_tags(previous, probs, 0.5).tolist() == [[1, 1, 0, 0]]


def test_advance_window_keeps_last_accepted_token_while_work_remains():
    tags = np.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    assert policy.advance_window(0, tags) == 2  # min 3 accepted, minus one: re-feed token 2
    done = np.ones((2, 4), dtype=int)
    assert policy.advance_window(2, done) == 4


def test_keep_through_first_eos():
    assert policy.keep_through_first_eos(np.array([4, 9, 7, 9, 2]), 9).tolist() == [True, True, False, False, False]
    assert policy.keep_through_first_eos(np.array([4, 5]), 9).all()


def test_gumbel_argmax_is_seeded_and_follows_the_distribution():
    logits = np.log(np.array([[0.7, 0.2, 0.1]] * 4000))
    a = policy.gumbel_argmax(logits, 1.0, np.random.default_rng(0))
    b = policy.gumbel_argmax(logits, 1.0, np.random.default_rng(0))
    assert (a == b).all()
    assert np.bincount(a, minlength=3) / len(a) == pytest.approx([0.7, 0.2, 0.1], abs=0.03)


# Candidates as the graphs emit them: most likely first, log-probabilities under the whole vocabulary.
PROBS = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
IDS = np.array([[7, 3, 9, 1, 4]] * 20000)
LOGPROBS = np.log(np.tile(PROBS * 0.9, (20000, 1)))  # 10% of the mass lies outside the 5 candidates


def _frequencies(**kwargs) -> np.ndarray:
    settings = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) | kwargs
    ids, probs = policy.sample_candidates(IDS, LOGPROBS, rng=np.random.default_rng(0), **settings)
    untempered = dict(zip(IDS[0].tolist(), PROBS * 0.9))  # the confidence: each draw's own probability
    assert np.allclose(probs, [untempered[i] for i in ids.tolist()])
    return np.array([np.mean(ids == t) for t in IDS[0]])


def test_sampling_draws_the_candidates_tempered_distribution():
    assert _frequencies() == pytest.approx(PROBS, abs=0.01)  # renormalized over the candidates
    hot = PROBS ** (1 / 2.0) / (PROBS ** (1 / 2.0)).sum()
    assert _frequencies(temperature=2.0) == pytest.approx(hot, abs=0.01)


@pytest.mark.parametrize("cut, kept", [(dict(top_k=2), [0.4, 0.3]), (dict(top_p=0.7), [0.4, 0.3]),
                                       (dict(top_p=0.71), [0.4, 0.3, 0.15]), (dict(min_p=0.3), [0.4, 0.3, 0.15]),
                                       (dict(top_k=1), [1.0]), (dict(top_p=0.01), [1.0])])
def test_top_k_top_p_and_min_p_cut_the_candidates(cut, kept):
    expect = np.zeros(5)
    expect[: len(kept)] = np.array(kept) / sum(kept)
    assert _frequencies(**cut) == pytest.approx(expect, abs=0.012)


def test_sampling_is_seeded():
    draw = lambda seed: policy.sample_candidates(IDS[:50], LOGPROBS[:50], 1.0, 0, 1.0, 0.0,  # noqa: E731
                                                 np.random.default_rng(seed))[0]
    assert (draw(3) == draw(3)).all() and not (draw(3) == draw(4)).all()


def test_causal_after_prefix():
    m = masks.causal_after(2, 3)[0]
    assert m.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


def test_rows_share_the_prefix_see_own_private_tokens_and_never_a_sibling():
    # prefix 2, 2 scratch rows of stride 3 with 1 private token each, windows of 2
    m = masks.rows_over_prefix(prefix=2, scratch_rows=2, row_stride=3, private=1, rows=2, window=2)[0]
    past = 2 + 2 * 3
    assert m.shape == (4, past + 4)
    row0, row1 = m[:2], m[2:]
    assert row0[:, :2].all() and row1[:, :2].all()  # the shared prefix
    assert row0[:, 2].all() and not row0[:, 3:5].any() and not row0[:, 5:8].any()  # own private token only
    assert row1[:, 5].all() and not row1[:, 2:5].any() and not row1[:, 6:8].any()
    assert row0[:, past:past + 2].tolist() == [[1, 0], [1, 1]] and not row0[:, past + 2:].any()
    assert row1[:, past + 2:].tolist() == [[1, 0], [1, 1]] and not row1[:, past:past + 2].any()


def test_rows_without_private_tokens_read_the_prefix_alone():
    m = masks.rows_over_prefix(prefix=3, scratch_rows=2, row_stride=4, private=0, rows=2, window=4)
    assert m.shape == (1, 8, 3 + 8)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(slot_threshold=1.5), "slot_threshold=1.5 is outside [0, 1]"),
    (dict(token_threshold=-0.1), "token_threshold=-0.1 is outside [0, 1]"),
    (dict(gen_length=0), "gen_length=0 must be a positive integer"),
    (dict(gen_length=64, slot_size=8, serial_num_blocks=3), "serial_num_blocks may be one of [1, 2, 4, 8]"),
    (dict(temperature=-1.0), "temperature=-1.0 must be >= 0"),
])
def test_params_errors_name_the_value_and_the_fix(kwargs, fragment):
    with pytest.raises(RefusionError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        DecodeParams(**kwargs)


def test_gen_length_padded_to_whole_slots_as_upstream():
    p = DecodeParams(gen_length=30, slot_size=4, serial_num_blocks=2)
    assert p.padded_gen_length == 32 and p.block_length == 16


@pytest.mark.parametrize("probs", [[0.5, 0.25], [0.5, 0.0]])
def test_commit_logprobs_are_numpys_logs_and_a_zero_is_minus_infinity(probs, recwarn):
    p = np.array(probs, np.float32)
    alternatives = np.array([[[3, -0.5]], [[4, -1.5]]])
    logprobs, alts = policy.commit_logprobs(p, alternatives)
    assert logprobs == tuple(np.log(p.astype(np.float64), where=p > 0, out=np.full(2, -np.inf)).tolist())
    assert alts == (((3, -0.5),), ((4, -1.5),)) and not recwarn.list  # a zero warns of no division
    assert policy.commit_logprobs(p, np.zeros((2, 0, 2)))[1] == ()


@pytest.mark.parametrize("confidence, chosen", [
    ([0.1] * 8, 4),  # the first slot always
    ([0.1, 0.1, 0.1, 0.1, 0.9, 0.0, 0.0, 0.0], 8),  # the next slot's first draft clears the threshold
    ([0.9, 0.9, 0.9, 0.9, 0.2, 0.9, 0.9, 0.9, 0.9], 4),  # one that does not ends the run, whatever follows
    ([], 0), ([0.9, 0.9], 4),
])
def test_the_guided_loop_verifies_the_leading_slots_while_each_first_draft_is_confident(confidence, chosen):
    assert policy.leading_slots(confidence, 4, 0.5) == chosen


def test_a_run_is_accepted_up_to_its_first_rejected_token():
    assert policy.accepted_prefix(np.array([0.9, 0.8, 0.05, 0.9]) > 0.1) == 2
    assert policy.accepted_prefix(np.array([0.05, 0.9]) > 0.1) == 0 and policy.accepted_prefix(np.zeros(0) > 0) == 0
    assert policy.accepted_prefix(np.array([[True, True], [False, True]])) == 2  # read flat, as verification's prefix
