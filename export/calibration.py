"""The prompts int4-awq calibrates on, as token ids, and the sha256 refusion.json records of them.

Either the built-in set below or a text file with one prompt per line (`--calibration FILE`;
blank lines are skipped). Every prompt is a user message in the checkpoint's chat template (raw
text when it has none), as the runtime feeds prompts. The built-in set is:

- TASK_EXAMPLES: the last 32 examples of refusion.tools.tasks' reserved held-out stream (examples
  1968-1999: disjoint from training data and from the `held_out(200)` the benchmarks score), each
  followed by its answer; every second one has the answer's tokens replaced by the mask token,
  which is what the planner sees (tests/export/test_calibration.py regenerates the list).
- GENERIC_TEXT: a few paragraphs of plain English, code and numbers, so that a checkpoint other
  than the embedded toy model sees ordinary text too.

The recorded sha256 is of the token ids actually fed (a JSON list of lists), so it names the
prompts, the template, the tokenizer and the selection together.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from refusion.export.progress import Progress, line
from refusion.runtime.core.errors import RefusionError

if TYPE_CHECKING:
    from refusion.export.checkpoint import Checkpoint
    from refusion.runtime.tokenizer import Tokenizer

DEFAULT_SAMPLES = 64  # prompts used when --calibration-samples is not given (the built-in set has 40)

TASK_EXAMPLES: tuple[tuple[str, str], ...] = (
    ('add: 34+50', '34+50=84'),
    ('sort: 5 1 9 1 6', '1 1 5 6 9'),
    ('reverse: slddaakfwqgjyva', 'avyjgqwfkaaddls'),
    ('o5 i7 h1 u2; get o i h h o i i h', 'o5 i7 h1 h1 o5 i7 i7 h1'),
    ('list: 577,725,8,2,4,28,698', '[577, 725, 8, 2, 4, 28, 698]'),
    ('upper: qjliwk nwq', 'QJLIWK NWQ'),
    ('add: 461+600', '461+600=1061'),
    ('sort: 5 0 4 9 8 5 5 4 7', '0 4 4 5 5 5 7 8 9'),
    ('reverse: madcktfziqdr', 'rdqizftkcdam'),
    ('w8 l4 m5 y8 f4 u5 x3 c0; get x m x m l l w m', 'x3 m5 x3 m5 l4 l4 w8 m5'),
    ('list: 376,26,8', '[376, 26, 8]'),
    ('upper: cklad grmlq jb dg uberlw', 'CKLAD GRMLQ JB DG UBERLW'),
    ('add: 714+934', '714+934=1648'),
    ('sort: 6 3 6 2 5 0 9 3 8 0', '0 0 2 3 3 5 6 6 8 9'),
    ('reverse: yediodhfsnxrksiyeboacgt', 'tgcaobeyiskrxnsfhdoidey'),
    ('c4 m4 d2 h4; get d d d h m h', 'd2 d2 d2 h4 m4 h4'),
    ('list: 110,9,6,96', '[110, 9, 6, 96]'),
    ('upper: cnysdy mk', 'CNYSDY MK'),
    ('add: 4666+1052', '4666+1052=5718'),
    ('sort: 6 9 5 2 9 8 3 3 5 7 9', '2 3 3 5 5 6 7 8 9 9 9'),
    ('reverse: dufjxcwipiktcfynhfu', 'ufhnyfctkipiwcxjfud'),
    ('e8 m9 k7 p9 i9 r7 t4 z3; get z i m e p e r', 'z3 i9 m9 e8 p9 e8 r7'),
    ('list: 255,397,9,0', '[255, 397, 9, 0]'),
    ('upper: yaay zvgl ilwud hdhhy', 'YAAY ZVGL ILWUD HDHHY'),
    ('add: 6150+8392', '6150+8392=14542'),
    ('sort: 8 8 6 9 3 7 0 5', '0 3 5 6 7 8 8 9'),
    ('reverse: pigchbvxuvfhszo', 'ozshfvuxvbhcgip'),
    ('y1 z4 r9 s0 w1; get s w w s', 's0 w1 w1 s0'),
    ('list: 29,665,6,986,82,771', '[29, 665, 6, 986, 82, 771]'),
    ('upper: wkaankf jk vhffbcs aitbwwu', 'WKAANKF JK VHFFBCS AITBWWU'),
    ('add: 7919+7569', '7919+7569=15488'),
    ('sort: 1 4 4 8 5 0 7 3 0', '0 0 1 3 4 4 5 7 8'),
)

GENERIC_TEXT: tuple[str, ...] = (
    "The robot arm moves to the shelf, picks up the red box and places it on the conveyor belt.",
    "Summarize the following: the meeting was moved from Monday to Wednesday because two engineers "
    "were travelling, and the agenda now includes the quarterly budget review.",
    "def area(width: float, height: float) -> float:\n    return width * height",
    "Write a short poem about the sea at night, with the moon over quiet water.",
    "Translate to French: Where is the train station? I would like a ticket to Paris, please.",
    "The temperature rose from 12.5 C at 6:00 to 27 C at 14:00, then fell back to 18 C by 22:00.",
    "Explain why the sky is blue in two sentences, for a ten year old.",
    "List three safety rules for operating a drill press, then say which one matters most.",
)


def builtin_prompts() -> list[tuple[str, str | None, bool]]:
    """(prompt, completion or None, completion masked) of the built-in set, in order."""
    tasks = [(prompt, answer, i % 2 == 1) for i, (prompt, answer) in enumerate(TASK_EXAMPLES)]
    return tasks + [(text, None, False) for text in GENERIC_TEXT]


def read_prompts(file: Path) -> list[str]:
    """The non-blank lines of a calibration file, refused when missing, unreadable, not text or empty."""
    fix = "pass a UTF-8 text file with one prompt per line, or leave --calibration out for the built-in set"
    if not file.exists():
        raise RefusionError(f"calibration file {file} does not exist; {fix}.")
    if not file.is_file():
        raise RefusionError(f"calibration file {file} is not a regular file; {fix}.")
    try:
        data = file.read_bytes()
    except OSError as e:
        raise RefusionError(f"calibration file {file} cannot be read ({e.strerror}); {fix}.") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RefusionError(f"calibration file {file} is not text: byte {data[e.start]:#04x} at offset {e.start} "
                            f"is not UTF-8; {fix}.") from e
    if "\0" in text:
        raise RefusionError(f"calibration file {file} is not text: it holds NUL bytes (offset {text.index(chr(0))}); "
                            f"{fix}.")
    prompts = [stripped for raw in text.splitlines() if (stripped := raw.strip())]
    if not prompts:
        raise RefusionError(f"calibration file {file} is empty (no non-blank line); {fix}.")
    return prompts


def calibration_set(ckpt: Checkpoint, file: Path | None, samples: int | None,
                    progress: Progress) -> tuple[list[list[int]], str]:
    """(token ids per prompt, sha256 of them): the first `samples` prompts of `file` or the built-in set."""
    from refusion.runtime.tokenizer import Tokenizer

    if samples is not None and samples < 1:
        raise RefusionError(f"--calibration-samples {samples}: needs at least 1 prompt.")
    source = [(p, None, False) for p in read_prompts(Path(file))] if file is not None else builtin_prompts()
    wanted = samples or DEFAULT_SAMPLES
    chosen = source[:wanted]
    tok = Tokenizer.from_dir(ckpt.path)
    ids = [_encode(tok, prompt, completion, masked, ckpt.mask_token_id) for prompt, completion, masked in chosen]
    limit = ckpt.dims.max_position_embeddings
    for n, prompt_ids in enumerate(ids, 1):
        if len(prompt_ids) > limit:
            where = f"line {_line_of(Path(file), n)} of {file}" if file is not None else f"built-in prompt {n}"
            raise RefusionError(f"calibration prompt {where} is {len(prompt_ids)} tokens (chat template included), "
                                f"longer than the model's max_position_embeddings {limit}; shorten or split it.")
    sha = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
    what = f"{file}" if file is not None else "the built-in set"
    short = f" ({len(source)} available)" if samples is not None and samples > len(source) else ""
    line(progress, f"calibration: {len(ids)} prompts of {what}{short}, {sum(map(len, ids))} tokens, sha256 {sha[:12]}")
    return ids, sha


def _encode(tok: Tokenizer, prompt: str, completion: str | None, masked: bool, mask_id: int) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if tok.chat_template else prompt
    ids = tok.encode(text)
    if completion is not None:
        answer = tok.encode(completion)
        ids += [mask_id] * len(answer) if masked else answer
    return ids


def _line_of(file: Path, n: int) -> int:
    """The line number of the n-th non-blank line."""
    count = 0
    for number, raw in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        count += bool(raw.strip())
        if count == n:
            return number
    return n
