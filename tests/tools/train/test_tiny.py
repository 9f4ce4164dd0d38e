"""The training script tools/train/tiny.py: the ReFusion sequences it trains on, and runs that
are bit-for-bit reproducible and resume exactly where they stopped."""

from __future__ import annotations

import hashlib
import random
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from refusion.tools.train import tiny as TT

# A one-layer model and a few steps: seconds, yet every part of the loop (micro-batches,
# clipping, AdamW, the schedule, state saves) runs.
TINY_RUN = ["--layers", "1", "--hidden", "32", "--intermediate", "64", "--heads", "2", "--kv-heads", "1",
            "--head-dim", "16", "--steps", "6", "--warmup", "2", "--batch-size", "8", "--micro-batches", "2",
            "--save-every", "3", "--log-every", "2", "--eval-every", "0", "--threads", "1"]


# ----------------------------------------------------------------------------- training sequences


def test_refusion_sequence_layout():
    ids = TT.Ids(pad=100, eos=102, mask=103, vocab=104)
    args = TT.parser().parse_args(["train"])
    prompt, response = list(range(10)), [20 + i for i in range(13)] + [ids.eos]
    rng = random.Random(0)
    seen_masked = seen_clean = 0
    for _ in range(200):
        s = TT.refusion_sequence(prompt, response, rng, args, ids)
        p0 = len(prompt)
        assert s.ids[:p0] == prompt and s.pos[:p0] == list(range(p0))
        span = len(s.ids) - p0
        assert sorted(s.pos[p0:]) == list(range(p0, p0 + span))  # every response position once
        truth = response + [ids.pad] * (span - len(response))
        masked = [j for j in range(p0, len(s.ids)) if s.ids[j] == ids.mask]
        clean = [j for j in range(p0, len(s.ids)) if s.ids[j] != ids.mask]
        assert masked == list(range(len(s.ids) - len(masked), len(s.ids)))  # masks come last...
        assert [s.pos[j] for j in masked] == sorted(s.pos[j] for j in masked)  # ...in position order
        for j in masked:
            assert s.mdm[j] == truth[s.pos[j] - p0] and s.ar[j] == TT.IGNORE
        for j in clean:
            assert s.ids[j] == truth[s.pos[j] - p0] and s.mdm[j] == TT.IGNORE
            nxt = j + 1 < len(s.ids) and s.ids[j + 1] != ids.mask and s.pos[j + 1] == s.pos[j] + 1
            assert s.ar[j] == (s.ids[j + 1] if nxt else TT.IGNORE)
        assert s.ar[p0 - 1] in (TT.IGNORE, response[0]) and all(a == TT.IGNORE for a in s.ar[: p0 - 1])
        assert s.weight > 0
        seen_masked += bool(masked)
        seen_clean += bool(clean)
    assert seen_masked and seen_clean


def test_plain_ar_examples_are_whole_and_in_order():
    ids = TT.Ids(pad=100, eos=102, mask=103, vocab=104)
    args = TT.parser().parse_args(["train"])
    prompt, response = list(range(10)), [20 + i for i in range(13)] + [ids.eos]
    s = TT.refusion_sequence(prompt, response, random.Random(0), args, ids, ordered_prob=1.0)
    assert ids.mask not in s.ids and s.pos == list(range(len(s.ids)))
    assert s.ar[len(prompt) - 1:len(prompt) + len(response) - 1] == response  # next-token targets throughout


def test_prefix_examples_are_a_clean_prefix_then_masks_to_the_end():
    ids = TT.Ids(pad=100, eos=102, mask=103, vocab=104)
    args = TT.parser().parse_args(["train"])
    prompt, response = list(range(10)), [20 + i for i in range(13)] + [ids.eos]
    rng = random.Random(0)
    cuts = set()
    for _ in range(200):
        s = TT.prefix_sequence(prompt, response, rng, args, ids)
        p0, c = len(prompt), s.ids.index(ids.mask) - len(prompt)
        truth = response + [ids.pad] * (len(s.ids) - p0 - len(response))
        cuts.add(c)
        assert s.pos == list(range(len(s.ids))) and s.ids == prompt + truth[:c] + [ids.mask] * (len(truth) - c)
        assert s.ar == [TT.IGNORE] * (p0 - int(c > 0)) + truth[:c + int(c > 0)] + [TT.IGNORE] * (len(truth) - c)
        assert s.mdm == [TT.IGNORE] * (p0 + c) + truth[c:] and s.weight == 1 / (len(truth) - c)
    assert cuts == set(range(len(response)))  # from no prefix to all but the EOS
    assert {TT.prefix_sequence(prompt, response, rng, args, ids, first=9).ids.index(ids.mask) - len(prompt)
            for _ in range(100)} == set(range(9, len(response)))
    late = TT.parser().parse_args(["train", "--prefix-prob", "1", "--add-cut-in-sum", "--tasks", "add",
                                   "--task-weights", ""])
    enc = TT.Encoder(TT.build_tokenizer())
    turn = enc.prompt("")[-3:]  # <|im_start|>assistant\n, where the answer starts
    for q in TT.batch_for_step(late.ar_steps, enc, late):
        start = max(i for i in range(len(q.ids)) if q.ids[i:i + 3] == turn) + 3
        assert q.pos == list(range(len(q.ids)))
        assert re.fullmatch(r"\d+\+\d+=\d*", enc.decode(q.ids[start:q.ids.index(enc.ids.mask)]))  # cut in the sum


def test_the_curriculum_and_the_conversations_around_a_task():
    tok = TT.build_tokenizer()
    enc = TT.Encoder(tok)
    args = TT.parser().parse_args(["train"])
    rng = random.Random(0)
    for progress in (0.0, 0.5, 1.0):
        for _ in range(50):
            ex = TT.easier_lookup(rng, progress)
            table, queries = ex.prompt.split("; get ")
            assert 2 <= len(table.split()) <= 2 + round(7 * progress) and 1 <= len(queries.split()) <= 1 + round(7 * progress)
    early, late = TT.batch_for_step(0, enc, args), TT.batch_for_step(args.ar_steps, enc, args)
    assert not any(enc.ids.mask in s.ids for s in early)  # the AR phase: plain next-token examples only
    assert any(enc.ids.mask in s.ids for s in late)
    texts = [tok.decode(s.ids) for step in range(3) for s in TT.batch_for_step(step, enc, args)]
    assert any("<|im_start|>system" in t for t in texts) and any(t.count("<|im_start|>user") > 1 for t in texts)
    assert all(max(s.pos) < 256 for step in range(3) for s in TT.batch_for_step(step, enc, args))  # fits the positions


# ----------------------------------------------------------------------------- training runs


@pytest.fixture(autouse=True)
def _restore_torch_globals():
    """train() sets torch's thread count and deterministic mode for the whole process."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _train(work: Path, *extra: str) -> str:
    """Train (or resume) in `work`; the sha256 of the saved weights."""
    TT.main(["train", *TINY_RUN, "--work-dir", str(work), "--out", str(work / "model"), *extra])
    return hashlib.sha256((work / "model" / "model.safetensors").read_bytes()).hexdigest()


def test_training_is_bit_reproducible_and_logs_the_digest(tmp_path):
    first = _train(tmp_path / "a")
    assert _train(tmp_path / "b") == first
    assert _train(tmp_path / "other-seed", "--seed", "1") != first
    done = re.search(r"done: 6 steps .* sha256 ([0-9a-f]{64})", (tmp_path / "a" / "train.log").read_text())
    assert done and done.group(1) == first


def test_an_interrupted_run_resumes_to_the_same_weights(tmp_path, monkeypatch):
    straight = _train(tmp_path / "straight")
    save_state = TT.save_state

    def save_then_interrupt(path, *args, **kwargs):
        save_state(path, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(TT, "save_state", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / "resumed")
    monkeypatch.undo()
    assert not (tmp_path / "resumed" / "model").exists()
    assert _train(tmp_path / "resumed") == straight
    assert "resumed from" in (tmp_path / "resumed" / "train.log").read_text()


def test_resuming_with_other_hyperparameters_is_refused(tmp_path):
    _train(tmp_path / "run")
    with pytest.raises(SystemExit, match=r"other hyperparameters .*'lr': \(0.002, 0.001\).*--restart"):
        _train(tmp_path / "run", "--lr", "1e-3")


def test_a_state_saved_before_a_hyperparameter_existed_resumes_at_its_old_value(tmp_path):
    straight = _train(tmp_path / "straight")
    TT.main(["train", *TINY_RUN, "--work-dir", str(tmp_path / "old"), "--out", str(tmp_path / "old" / "model"),
             "--stop-after", "3"])
    path = tmp_path / "old" / "state.pt"
    state = torch.load(path, weights_only=False)
    for name in TT.HYPER_ADDED:
        del state["hyper"][name]
    torch.save(state, path)
    assert _train(tmp_path / "old") == straight
    with pytest.raises(SystemExit, match=r"'prefix_prob': \(0.0, 0.5\)"):
        _train(tmp_path / "old", "--prefix-prob", "0.5")


def test_a_second_stage_starts_from_another_runs_state_and_is_itself_reproducible(tmp_path):
    first = _train(tmp_path / "first")
    init = ["--init-from", str(tmp_path / "first" / "state.pt"), "--seed", "1", "--task-weights", "add:5"]
    second = _train(tmp_path / "second", *init)
    assert _train(tmp_path / "again", *init) == second
    assert second not in (first, _train(tmp_path / "scratch", "--seed", "1", "--task-weights", "add:5"))
    assert "initialized from" in (tmp_path / "second" / "train.log").read_text()
    with pytest.raises(SystemExit, match="no such state file"):
        _train(tmp_path / "missing", "--init-from", str(tmp_path / "nothing.pt"))


def test_stop_after_saves_the_state_of_that_step_and_a_rerun_goes_on_to_the_same_weights(tmp_path):
    straight = _train(tmp_path / "straight")
    TT.main(["train", *TINY_RUN, "--work-dir", str(tmp_path / "cut"), "--out", str(tmp_path / "cut" / "model"),
             "--stop-after", "4"])
    assert torch.load(tmp_path / "cut" / "state.pt", weights_only=False)["step"] == 4
    assert not (tmp_path / "cut" / "model").exists()
    assert _train(tmp_path / "cut") == straight


# ----------------------------------------------------------------------------- evaluation


class _Oracle(torch.nn.Module):
    """Knows each prompt's true answer: at a real token it predicts the next true token (the AR reading),
    at a mask its own (the mask readings); `wrong_units` makes a mask miss every units digit."""

    def __init__(self, enc, examples, wrong_units=False):
        super().__init__()
        self.enc, self.wrong_units = enc, wrong_units
        self.truth = {tuple(enc.prompt(e.prompt)): (e, enc.response(e.answer)) for e in examples}

    def forward(self, input_ids, position_ids):
        fed = input_ids[0].tolist()
        (prompt, (ex, response)), = [(k, v) for k, v in self.truth.items() if tuple(fed[:len(k)]) == k]
        p0 = len(prompt)
        full = list(prompt) + response + [self.enc.ids.pad]
        logits = torch.zeros(1, len(fed), self.enc.ids.vocab)
        for i, token in enumerate(fed):
            target = full[i] if token == self.enc.ids.mask else full[i + 1]
            if token == self.enc.ids.mask and self.wrong_units and i - p0 == len(ex.answer) - 1:
                target = self.enc.ids.pad
            logits[0, i, target] = 1.0
        return type("Out", (), {"logits": logits})


def test_add_places_reads_each_sum_digit_by_place_both_ways():
    enc = TT.Encoder(TT.build_tokenizer())
    examples = [e for e in TT.T.held_out(60) if e.task == "add"][:6]
    assert examples and all("=" in e.answer for e in examples)
    longest = max(len(e.answer.split("=")[1]) for e in examples)
    right = [1.0] * longest
    assert TT.add_places(_Oracle(enc, examples), enc, examples) == {"AR": right, "mask": right, "draft": right}
    wrong = [0.0] + [1.0] * (longest - 1)
    assert TT.add_places(_Oracle(enc, examples, wrong_units=True), enc, examples) == {
        "AR": right, "mask": wrong, "draft": wrong}


# ----------------------------------------------------------------------------- the structured families (stage 8)


def test_a_mix_with_the_families_trains_their_conversations_within_the_positions():
    tok = TT.build_tokenizer()
    enc = TT.Encoder(tok)
    args = TT.parser().parse_args(["train", "--ar-steps", "0", "--max-positions", "512", "--tasks",
                                   "add,sort,json,robot,tool", "--task-weights", "tool:4"])
    seqs = [s for step in range(4) for s in TT.batch_for_step(step, enc, args)]
    texts = [tok.decode(s.ids) for s in seqs]
    assert any("<tools>\n" in t for t in texts) and any('{"answer": ' in t or "JSON" in t for t in texts)
    assert any(tok.convert_tokens_to_ids("<tool_call>") in s.ids + s.mdm for s in seqs)  # a call, clean or masked
    assert all(max(s.pos) < 512 for s in seqs)
    with pytest.raises(SystemExit, match=r"--tasks names \['nope'\]"):
        TT.task_mix(TT.parser().parse_args(["train", "--tasks", "add,nope"]))


def test_a_stage_starts_from_a_saved_models_weights_with_the_vocabulary_grown(tmp_path):
    from safetensors.torch import load_file, save_file

    _train(tmp_path / "run")
    weights = load_file(tmp_path / "run" / "model" / "model.safetensors")
    old = {name: (t[:104].clone() if name in ("model.embed_tokens.weight", "lm_head.weight") else t)
           for name, t in weights.items()}  # the vocabulary before the tool tags
    (tmp_path / "old").mkdir()
    save_file(old, tmp_path / "old" / "model.safetensors")
    args = TT.parser().parse_args(["train", *TINY_RUN])
    tok = TT.build_tokenizer()
    model = TT.build_model(args, len(tok), TT.Encoder(tok).ids)
    TT.init_weights(model, tmp_path / "old", TT.Log(tmp_path / "log"))
    grown = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(grown[name][:104], old[name])
        assert torch.allclose(grown[name][104:], old[name].mean(0).expand(len(tok) - 104, -1))
    assert "initialized from the weights of" in (tmp_path / "log").read_text()
    with pytest.raises(SystemExit, match="no model.safetensors there"):
        TT.init_weights(model, tmp_path / "nothing", TT.Log(tmp_path / "log"))
