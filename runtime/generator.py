"""`Generator`: the runtime's public face. Tokenize, decode on a Runner, detokenize, report.

    gen = Generator.from_dir("out/refusion-onnx", backend="auto")
    res = gen.generate("Write a function that ...", gen_length=512)  # settings left out: the export's defaults
    for piece in gen.stream(messages=[{"role": "user", "content": "..."}]): print(piece, end="")
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from numbers import Integral
from pathlib import Path
from typing import Any

from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.decode import (
    Commit,
    DecodeTrace,
    Tokens,
    ar_decode,
    refusion_decode,
)
from refusion.runtime.params import DecodeParams
from refusion.runtime.runners import make_runner
from refusion.runtime.runners.base import Runner
from refusion.runtime.tokenizer import Tokenizer


@dataclass
class GenerationStats:
    mode: str
    backend: str
    prompt_tokens: int
    tokens: int  # generated tokens up to and including the first EOS
    forwards: dict[str, int]
    forward_count: int
    tokens_per_forward: float  # tokens / forwards
    tpf: float  # upstream's per-iteration TPF
    wall_seconds: float
    engine_seconds: float  # inside the runner (graphs and KV moves)
    loop_seconds: float  # everything else: policy, masks, bookkeeping
    tokens_per_second: float
    branches: dict[str, int] = field(default_factory=dict)

    @property
    def loop_share(self) -> float:
        return self.loop_seconds / self.wall_seconds if self.wall_seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "loop_share": round(self.loop_share, 4)}


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # generated ids in position order, prompt excluded
    prompt_ids: list[int]
    stats: GenerationStats
    commits: list[Commit]  # what became final at each loop iteration, in order

    @property
    def steps(self) -> list[int]:
        """For each token (position order), the loop iteration that committed it."""
        step = {p: c.step for c in self.commits for p in c.positions}
        return [step[p] for p in sorted(step)]


class Generator:
    def __init__(self, manifest: ExportManifest, runner: Runner, tokenizer: Tokenizer | None):
        self.manifest = manifest
        self.runner = runner
        self.tokenizer = tokenizer

    @staticmethod
    def from_dir(path: str | Path, backend: str = "auto", threads: int | None = None, verify: bool = False,
                 low_memory: bool = False) -> Generator:
        """Load an export or engines directory; `verify` also checks every file's sha256 (a full read);
        `low_memory` (onnxruntime only) turns off weight prepacking: about half the peak memory, ~30% slower
        forwards."""
        manifest = ExportManifest.read(Path(path))
        manifest.check_files(verify, manifest.tokenizer_files)
        runner = make_runner(manifest, backend, threads, verify, low_memory)
        tokenizer = Tokenizer.from_dir(manifest.path) if manifest.tokenizer_files else None
        runner.activate()
        return Generator(manifest, runner, tokenizer)

    def close(self) -> None:
        self.runner.deactivate()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- prompts -----------------------------------------------------------------------
    def prompt_ids(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        prompt_ids: list[int] | None = None,
        chat: bool = False,
        enable_thinking: bool = True,
    ) -> list[int]:
        given = sum(x is not None for x in (prompt, messages, prompt_ids))
        if given != 1:
            raise RefusionError("give exactly one of a prompt, messages, or prompt_ids.")
        if prompt is not None and not isinstance(prompt, str):
            raise RefusionError(f"prompt={prompt!r} is not a string; pass text, or token ids as prompt_ids=[...].")
        if messages is not None and not _is_chat(messages):
            raise RefusionError(f"messages={messages!r} is not a list of {{'role': ..., 'content': ...}} dicts; "
                                "pass e.g. messages=[{'role': 'user', 'content': 'hi'}].")
        if prompt_ids is not None:
            if chat:
                raise RefusionError("chat=True does not combine with prompt_ids: token ids are fed exactly as given, "
                                    "without the chat template; drop chat=True, or pass the prompt text instead.")
            ids = self._token_ids(prompt_ids)
        else:
            tok = self._tokenizer()
            if messages is None and chat:
                messages = [{"role": "user", "content": prompt}]
            text = tok.apply_chat_template(messages, enable_thinking=enable_thinking) if messages else prompt
            ids = tok.encode(text or "")
        if not ids:
            raise RefusionError("the prompt is empty; give at least one token of prompt.")
        return ids

    def _token_ids(self, prompt_ids: Iterable[int]) -> list[int]:
        if isinstance(prompt_ids, (str, bytes)) or not isinstance(prompt_ids, Iterable):
            raise RefusionError(f"prompt_ids={prompt_ids!r} is not a list of integer token ids; "
                                "pass e.g. prompt_ids=[1, 2, 3].")
        ids = list(prompt_ids)
        vocab = self.manifest.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, Integral):
                raise RefusionError(f"prompt_ids[{i}]={t!r} is not an integer token id; "
                                    f"pass whole numbers in [0, {vocab}).")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RefusionError(f"prompt id {bad[0]} is outside the vocabulary [0, {vocab}).")
        return [int(t) for t in ids]

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RefusionError(f"{self.manifest.path} carries no tokenizer files; pass prompt_ids (--prompt-ids) instead.")
        return self.tokenizer

    # -- generation ----------------------------------------------------------------------
    def decode(self, ids: list[int], params: DecodeParams) -> Iterator[Commit | GenerationResult]:
        """Yield each commit as it happens, then the result."""
        if len(ids) + params.positions > self.manifest.max_positions:
            raise RefusionError(
                f"prompt of {len(ids)} tokens + gen_length {params.positions} exceeds the model's "
                f"{self.manifest.max_positions} positions; shorten the prompt or gen_length."
            )
        self.runner.check_request(len(ids), params)
        tokens = Tokens(ids, self.manifest.mask_token_id, self.manifest.eos_token_id)
        trace = DecodeTrace()
        loop = refusion_decode if params.mode == "refusion" else ar_decode
        engine0, t0 = self.runner.engine_seconds, time.perf_counter()
        commits: list[Commit] = []
        for commit in loop(self.runner, tokens, params, trace, self.manifest.has_logits):
            commits.append(commit)
            yield commit
        wall = time.perf_counter() - t0
        engine = self.runner.engine_seconds - engine0
        committed = {p: t for c in commits for p, t in zip(c.positions, c.token_ids)}
        token_ids = [committed[p] for p in sorted(committed)]
        upto_eos = _through_eos(token_ids, tokens.eos_id)
        forward_count = sum(trace.forwards.values())
        stats = GenerationStats(
            mode=params.mode,
            backend=self.runner.name,
            prompt_tokens=len(ids),
            tokens=len(upto_eos),
            forwards=dict(trace.forwards),
            forward_count=forward_count,
            tokens_per_forward=len(upto_eos) / forward_count if forward_count else 0.0,
            tpf=trace.tpf,
            wall_seconds=wall,
            engine_seconds=engine,
            loop_seconds=wall - engine,
            tokens_per_second=len(upto_eos) / wall if wall else 0.0,
            branches=dict(trace.branches),
        )
        text = self.tokenizer.decode(_before_eos(token_ids, tokens.eos_id)) if self.tokenizer else ""
        yield GenerationResult(text, token_ids, ids, stats, commits)

    def params(self, **settings: Any) -> DecodeParams:
        """Decode settings; those left out (or None) take the values the export recorded for this model."""
        return DecodeParams.with_defaults(self.manifest.defaults, **settings)

    def generate(self, prompt: str | None = None, *, messages=None, prompt_ids=None, chat: bool = False,
                 enable_thinking: bool = True, **settings: Any) -> GenerationResult:
        """Decode settings (gen_length, slot_size, ...) left out take the export's recorded defaults."""
        params = self.params(**settings)
        ids = self.prompt_ids(prompt, messages=messages, prompt_ids=prompt_ids, chat=chat, enable_thinking=enable_thinking)
        result = None
        for event in self.decode(ids, params):
            result = event
        assert isinstance(result, GenerationResult)
        return result

    def stream(self, prompt: str | None = None, *, messages=None, prompt_ids=None, chat: bool = False,
               enable_thinking: bool = True, **settings: Any) -> Iterator[str]:
        """Text as the settled prefix grows: slots commit out of order, a reader sees only text
        whose every earlier position is committed, in order, up to the first EOS (not shown)."""
        params = self.params(**settings)
        ids = self.prompt_ids(prompt, messages=messages, prompt_ids=prompt_ids, chat=chat, enable_thinking=enable_thinking)
        tok = self._tokenizer()
        eos = self.manifest.eos_token_id
        settled: list[int] = []
        pending: dict[int, int] = {}
        shown = ""
        done = False
        for event in self.decode(ids, params):
            if not isinstance(event, Commit) or done:
                continue
            pending.update(zip(event.positions, event.token_ids))
            while not done and len(ids) + len(settled) in pending:
                token = pending.pop(len(ids) + len(settled))
                done = token == eos
                if not done:
                    settled.append(token)
            text = tok.decode(settled)
            if text.endswith("\ufffd") and not done:  # an incomplete UTF-8 sequence: wait for the rest
                continue
            if len(text) > len(shown):
                yield text[len(shown):]
                shown = text


def _is_chat(messages: Any) -> bool:
    return isinstance(messages, (list, tuple)) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in messages)


def _before_eos(token_ids: list[int], eos_id: int) -> list[int]:
    """The answer: generated ids before the first EOS, the EOS itself not shown whatever the tokenizer's flags."""
    return token_ids[: token_ids.index(eos_id)] if eos_id in token_ids else token_ids


def _through_eos(token_ids: list[int], eos_id: int) -> list[int]:
    return token_ids[: token_ids.index(eos_id) + 1] if eos_id in token_ids else token_ids
