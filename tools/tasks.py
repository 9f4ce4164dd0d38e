"""Generated tasks with exactly checkable answers, for training and evaluating a tiny ReFusion model.

Every example is a (task, prompt, answer) triple of plain printable ASCII; the answer is a
deterministic function of the prompt, so accuracy is exact match (`score`). Answers run
from 7 to about 45 characters (the tiny model's tokenizer is character-level, so that
many tokens), varied within every task, so that slots and the place of EOS both matter.

    rng = random.Random(0)
    ex = make_example(rng)                 # one example, a task drawn uniformly
    train = make_dataset(seed=1, n=1000)   # never overlaps held_out()
    test = held_out(200)                   # tasks in round-robin order, fixed seed
    score(test[0], "  " + test[0].answer)  # True: exact match after stripping

The held-out set is the first `HELD_OUT_RESERVED` examples of a stream drawn with
`HELD_OUT_SEED`; `make_dataset` refuses that seed and skips any example whose prompt is
in the reserved set, so training and held-out data are disjoint by content, not only by
seed.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

HELD_OUT_SEED = 1_000_003
HELD_OUT_RESERVED = 2000  # held_out(n) is disjoint from training for every n up to this

# Words the chat template spells as single tokens; random letter strings never contain them
# so a prompt or answer tokenizes character by character.
RESERVED_WORDS = ("user", "assistant", "system")

_LOWER = string.ascii_lowercase


@dataclass(frozen=True)
class Example:
    """A task's prompt and answer; the structured families (tools/families.py) add the conversation around the
    prompt, the functions offered and the guide the answer follows."""

    task: str
    prompt: str
    answer: str
    before: tuple[dict[str, Any], ...] = ()  # messages ahead of the user's prompt (a system message)
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI `tools` offered
    after: tuple[dict[str, Any], ...] = ()  # messages after it (the assistant's call and the tool's result)
    schema: dict[str, Any] | None = field(default=None, hash=False, compare=False)  # the answer's JSON schema
    call: tuple[str, dict[str, Any]] | None = field(default=None, hash=False, compare=False)  # the call the answer is

    def messages(self) -> list[dict[str, Any]]:
        """The conversation the answer follows, as chat messages."""
        return [*self.before, {"role": "user", "content": self.prompt}, *self.after]


def letters(rng: random.Random, n: int) -> str:
    while True:
        s = "".join(rng.choice(_LOWER) for _ in range(n))
        if not any(w in s for w in RESERVED_WORDS):
            return s


def _number(rng: random.Random, digits: int) -> int:
    return rng.randint(10 ** (digits - 1), 10**digits - 1)


def _add(rng: random.Random) -> tuple[str, str]:
    """add: 4821+3950 -> 4821+3950=8771 (two operands of the same length, 2-4 digits)."""
    digits = rng.randint(2, 4)
    a, b = _number(rng, digits), _number(rng, digits)
    return f"add: {a}+{b}", f"{a}+{b}={a + b}"


def _sort(rng: random.Random) -> tuple[str, str]:
    """sort: 5 2 8 2 -> 2 2 5 8 (4-12 single digits, repeats allowed)."""
    xs = [rng.randint(0, 9) for _ in range(rng.randint(4, 12))]
    return "sort: " + " ".join(map(str, xs)), " ".join(map(str, sorted(xs)))


def _reverse(rng: random.Random) -> tuple[str, str]:
    """reverse: abcdefgh -> hgfedcba (8-24 lowercase letters)."""
    s = letters(rng, rng.randint(8, 24))
    return f"reverse: {s}", s[::-1]


def lookup_example(rng: random.Random, keys_range: tuple[int, int] = (4, 9),
                   queries_range: tuple[int, int] = (3, 8)) -> tuple[str, str]:
    """c3 a7 b1 d9; get b c b -> b1 c3 b1 (4-9 distinct letter keys, digit values, 3-8 queries; training's
    curriculum draws smaller tables)."""
    keys = rng.sample(_LOWER, rng.randint(*keys_range))
    values = {k: rng.randint(0, 9) for k in keys}
    queries = [rng.choice(keys) for _ in range(rng.randint(*queries_range))]
    table = " ".join(f"{k}{values[k]}" for k in keys)
    return f"{table}; get {' '.join(queries)}", " ".join(f"{q}{values[q]}" for q in queries)


def _list(rng: random.Random) -> tuple[str, str]:
    """list: 3,1,12 -> [3, 1, 12] (3-9 numbers below 1000)."""
    xs = [rng.randint(0, 10 ** rng.randint(1, 3) - 1) for _ in range(rng.randint(3, 9))]
    return "list: " + ",".join(map(str, xs)), "[" + ", ".join(map(str, xs)) + "]"


def _upper(rng: random.Random) -> tuple[str, str]:
    """upper: ab cdefg -> AB CDEFG (2-5 words of 2-7 letters, 8 characters or more)."""
    while True:
        text = " ".join(letters(rng, rng.randint(2, 7)) for _ in range(rng.randint(2, 5)))
        if len(text) >= 8:
            return f"upper: {text}", text.upper()


GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "add": _add,
    "sort": _sort,
    "reverse": _reverse,
    "lookup": lookup_example,
    "list": _list,
    "upper": _upper,
}
TASKS: tuple[str, ...] = tuple(GENERATORS)


def make_example(rng: random.Random, task: str | None = None, tasks: tuple[str, ...] = TASKS,
                 weights: tuple[float, ...] | None = None) -> Example:
    """One example of `task`, or of a task drawn from `tasks` (uniformly, or with `weights`)."""
    if task is None:
        task = rng.choice(tasks) if weights is None else rng.choices(tasks, weights)[0]
    if task not in GENERATORS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    prompt, answer = GENERATORS[task](rng)
    return Example(task, prompt, answer)


@lru_cache(maxsize=1)
def _held_out_stream() -> tuple[Example, ...]:
    rng = random.Random(HELD_OUT_SEED)
    out: list[Example] = []
    seen: set[str] = set()
    i = 0
    while len(out) < HELD_OUT_RESERVED:
        ex = make_example(rng, TASKS[i % len(TASKS)])
        if ex.prompt not in seen:  # no duplicate prompts inside the held-out set either
            seen.add(ex.prompt)
            out.append(ex)
            i += 1
    return tuple(out)


@lru_cache(maxsize=1)
def held_out_prompts() -> frozenset[str]:
    return frozenset(ex.prompt for ex in _held_out_stream())


def held_out(n: int = 200, seed: int = HELD_OUT_SEED) -> list[Example]:
    """The first n held-out examples, tasks in round-robin order (balanced per task)."""
    if seed != HELD_OUT_SEED:
        raise ValueError(f"the held-out set has one seed, {HELD_OUT_SEED}; got {seed}")
    if not 0 <= n <= HELD_OUT_RESERVED:
        raise ValueError(f"held_out(n) needs 0 <= n <= {HELD_OUT_RESERVED}; got {n}")
    return list(_held_out_stream()[:n])


def training_example(rng: random.Random, tasks: tuple[str, ...] = TASKS,
                     weights: tuple[float, ...] | None = None) -> Example:
    """A training example: never one whose prompt is in the held-out set."""
    reserved = held_out_prompts()
    while True:
        ex = make_example(rng, tasks=tasks, weights=weights)
        if ex.prompt not in reserved:
            return ex


def make_dataset(seed: int, n: int, tasks: tuple[str, ...] = TASKS) -> list[Example]:
    """n training examples drawn with `seed`, disjoint from the held-out set."""
    if seed == HELD_OUT_SEED:
        raise ValueError(f"seed {seed} is the held-out seed; training data must use another")
    rng = random.Random(seed)
    return [training_example(rng, tasks) for _ in range(n)]


def score(example: Example, text: str) -> bool:
    """Exact match of the answer, ignoring surrounding whitespace."""
    return text.strip() == example.answer.strip()


# Sentences a system prompt is made of in training (the model learns to read past them); the held-out
# tasks never depend on them.
_SYSTEM_SENTENCES = (
    "You are a helpful robot.", "You are a careful helper.", "Answer briefly.", "Be exact.",
    "Reply with the answer only.", "You run on a small board.", "Think of the task and answer it.",
    "Keep answers short.", "Never add extra words.", "You help a team of engineers.",
    "The user gives one task at a time.", "Tasks are checked exactly.", "Answer in plain text.",
)


def system_prompt(rng: random.Random, max_chars: int = 200) -> str:
    """A system prompt of 1 to 10 sentences, at most max_chars characters."""
    out: list[str] = []
    for _ in range(rng.randint(1, 10)):
        s = rng.choice(_SYSTEM_SENTENCES)
        if len(" ".join(out + [s])) > max_chars:
            break
        out.append(s)
    return " ".join(out) or _SYSTEM_SENTENCES[0]
