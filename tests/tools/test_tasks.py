"""The task generator (tools/tasks.py) and the shipped checkpoint models/refusion-tiny."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from refusion.tools import tasks as T

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "models" / "refusion-tiny"


# ----------------------------------------------------------------------------- tasks


def _solve(ex: T.Example) -> str:
    """Each task's answer computed independently from the prompt text."""
    p = ex.prompt
    if ex.task == "add":
        a, b = re.fullmatch(r"add: (\d+)\+(\d+)", p).groups()
        return f"{a}+{b}={int(a) + int(b)}"
    if ex.task == "sort":
        return " ".join(sorted(p.removeprefix("sort: ").split(), key=int))
    if ex.task == "reverse":
        return "".join(reversed(p.removeprefix("reverse: ")))
    if ex.task == "lookup":
        table, query = p.split("; get ")
        values = {pair[0]: pair[1:] for pair in table.split()}
        return " ".join(f"{q}{values[q]}" for q in query.split())
    if ex.task == "list":
        return "[" + ", ".join(p.removeprefix("list: ").split(",")) + "]"
    if ex.task == "upper":
        return p.removeprefix("upper: ").upper()
    raise AssertionError(ex.task)


def test_answers_are_correct_and_sized():
    rng = random.Random(7)
    for task in T.TASKS:
        lengths = set()
        for _ in range(300):
            ex = T.make_example(rng, task)
            assert ex.task == task
            assert ex.answer == _solve(ex), ex
            assert 7 <= len(ex.answer) <= 48, ex
            assert ex.prompt.isascii() and ex.answer.isascii()
            assert not any(w in ex.prompt or w in ex.answer for w in T.RESERVED_WORDS)
            lengths.add(len(ex.answer))
        assert len(lengths) >= 5, f"{task}: answer lengths should vary, got {sorted(lengths)}"


def test_dataset_is_deterministic_by_seed():
    assert T.make_dataset(3, 50) == T.make_dataset(3, 50)
    assert T.make_dataset(3, 50) != T.make_dataset(4, 50)
    assert {ex.task for ex in T.make_dataset(3, 200)} == set(T.TASKS)
    assert {ex.task for ex in T.make_dataset(5, 20, tasks=("upper",))} == {"upper"}


def test_held_out_is_fixed_balanced_and_disjoint():
    test = T.held_out(210)
    assert test == T.held_out(210)
    assert T.held_out(20) == test[:20]
    counts = {t: sum(e.task == t for e in test) for t in T.TASKS}
    assert set(counts.values()) == {210 // len(T.TASKS)}
    assert len({e.prompt for e in test}) == len(test)
    reserved = {e.prompt for e in T.held_out(T.HELD_OUT_RESERVED)}
    for seed in (0, 1, 2):
        assert not reserved & {e.prompt for e in T.make_dataset(seed, 3000)}
    with pytest.raises(ValueError):
        T.make_dataset(T.HELD_OUT_SEED, 1)
    with pytest.raises(ValueError):
        T.held_out(T.HELD_OUT_RESERVED + 1)
    with pytest.raises(ValueError):
        T.held_out(10, seed=T.HELD_OUT_SEED + 1)


def test_score_is_exact_match_after_strip():
    ex = T.Example("add", "add: 12+34", "12+34=46")
    assert T.score(ex, "12+34=46")
    assert T.score(ex, "  12+34=46\n")
    assert not T.score(ex, "12+34=47")
    assert not T.score(ex, "12+34=4")
    assert not T.score(ex, "12 + 34 = 46")
    assert not T.score(ex, "")
    with pytest.raises(ValueError):
        T.make_example(random.Random(0), "nope")


# ----------------------------------------------------------------------------- the shipped checkpoint


def test_refusion_tiny_loads_and_matches_its_config():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    if not (TINY / "config.json").is_file():
        pytest.fail(f"{TINY} is missing; train it with `python tools/train/tiny.py train`")
    config = json.loads((TINY / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    weights = TINY / "model.safetensors"
    assert weights.stat().st_size <= 20 * 1024 * 1024

    tok = transformers.AutoTokenizer.from_pretrained(TINY)
    assert len(tok) == config["vocab_size"]
    assert config["mask_token_id"] == tok.convert_tokens_to_ids("<|mask|>")
    assert tok.eos_token == "<|im_end|>" and config["eos_token_id"] == tok.eos_token_id
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"):
        assert tok.convert_tokens_to_ids(special) != tok.unk_token_id or special == tok.unk_token
    text = tok.apply_chat_template([{"role": "user", "content": "add: 1+2"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nadd: 1+2<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nadd: 1+2\nassistant\n"
    assert json.loads((TINY / "tokenizer_config.json").read_text())["chat_template"]

    model = transformers.Qwen3ForCausalLM.from_pretrained(TINY).eval()
    assert model.config.mask_token_id == config["mask_token_id"]
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert torch.isfinite(logits).all()
