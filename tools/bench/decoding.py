"""`refusion-run bench`: accuracy and speed of every decoding method on one checkpoint, one backend.

    refusion-run bench models/refusion-tiny [--n 200] [--threads 1] [--gen-length 64]
        [--settings "8,1,0.9,0.4;4,4,0.7,0.2"] [--diffusion "64,32;32,32"] [--no-reference] [--out results/bench]

On the first `n` prompts of the held-out task mix (`refusion.tools.tasks.held_out`, one fixed
seed), with greedy decoding and the same thread count everywhere (onnxruntime intra-op
threads = torch threads), it measures exact-match accuracy, tokens/forward, upstream's TPF,
tokens/s, wall time and the engine's share of it for
  (a) autoregressive decoding (runtime, onnxruntime CPU),
  (b) ReFusion decoding at each `--settings` entry (runtime, onnxruntime CPU),
  (c) LLaDA-style token-level masked diffusion without KV reuse (`runtime/decode/llada.py`, same
      runner and graphs) at each `--diffusion` entry,
  (d) the independent PyTorch reference loop (`tools/bench/reference.py`, HF
      transformers) on the same checkpoint: ReFusion at every setting (or the first, with
      --reference-settings first) and greedy AR.
Every method runs on every prompt in turn, the order rotated from prompt to prompt, after
a warm-up on other held-out prompts, so ratios of tokens/s come from interleaved runs in one
process and machine noise cancels; each ratio carries a bootstrap 95% interval over prompts.
Tokens are counted the same way for every method: generated tokens in position order up to
and including the first EOS (all of them when there is none).

Writes OUT/bench.md (tables, and ReFusion against the other methods), OUT/bench.json (everything, per prompt too)
and OUT/bench.png (accuracy against tokens/s, log x, one point per method and setting: the
shape of the paper's Figure 1; needs matplotlib).
"""

from __future__ import annotations

import cProfile
import functools
import json
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import click
import numpy as np

from refusion.export.progress import Progress, line, tick
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import MANIFEST_NAME, ExportManifest
from refusion.runtime.decode.llada import DiffusionParams
from refusion.runtime.generator import Generator
from refusion.runtime.params import DecodeParams
from refusion.tools import tasks as T
from refusion.tools.bench.common import host_info, profile_report, prompts_digest, resolve_model, through_eos
from refusion.tools.cli_common import progress as echo_progress
from refusion.tools.cli_common import quiet_option

# slot_size, serial_num_blocks, slot_threshold, token_threshold
DEFAULT_SETTINGS = "8,1,0.9,0.4;8,2,0.9,0.4;4,4,0.9,0.4;4,4,0.7,0.2;8,4,0.7,0.2;4,4,0.5,0.1"
# steps, block_length[, exit][, clean]: LLaDA's defaults (steps = gen_length, blocks of 32), then 2 tokens/step,
# then LLaDA's defaults stopped as soon as the answer is settled
DEFAULT_DIFFUSION = "64,32;32,32;64,32,exit"
DEFAULT_GEN_LENGTH = 64
BOOTSTRAP = 2000


# ----------------------------------------------------------------------------- settings


def parse_settings(text: str, gen_length: int, upstream_eos_drop: bool = False) -> list[DecodeParams]:
    """"8,1,0.9,0.4;4,2,0.9,0.4" -> ReFusion DecodeParams (validated)."""
    out = []
    for spec in _specs(text):
        parts = spec.split(",")
        if len(parts) != 4:
            raise RefusionError(f"--settings entry {spec!r} is not 'slot_size,serial_num_blocks,slot_threshold,token_threshold'.")
        try:
            k, blocks, s_thr, t_thr = int(parts[0]), int(parts[1]), float(parts[2]), float(parts[3])
        except ValueError as e:
            raise RefusionError(f"--settings entry {spec!r}: {e}") from e
        out.append(DecodeParams(gen_length=gen_length, slot_size=k, serial_num_blocks=blocks,
                                slot_threshold=s_thr, token_threshold=t_thr, mode="refusion",
                                upstream_eos_drop=upstream_eos_drop))
    return out


def parse_diffusion(text: str, gen_length: int) -> list[DiffusionParams]:
    """"64,32;32,32,exit;64,32,clean" -> DiffusionParams (steps, block_length, flags)."""
    out = []
    for spec in _specs(text):
        parts = [p.strip() for p in spec.split(",")]
        flags = set(parts[2:])
        if len(parts) < 2 or not flags <= {"exit", "clean"}:
            raise RefusionError(f"--diffusion entry {spec!r} is not 'steps,block_length[,exit][,clean]'.")
        try:
            steps, block = int(parts[0]), int(parts[1])
        except ValueError as e:
            raise RefusionError(f"--diffusion entry {spec!r}: {e}") from e
        out.append(DiffusionParams(gen_length=gen_length, steps=steps, block_length=block,
                                   order="clean_first" if "clean" in flags else "position", early_exit="exit" in flags))
    return out


def _specs(text: str) -> list[str]:
    return [s.strip() for s in text.split(";") if s.strip()]


def refusion_label(p: DecodeParams) -> str:
    return f"k={p.slot_size} blocks={p.serial_num_blocks} slot>{p.slot_threshold:g} tok>{p.token_threshold:g}"


def _refusion_id(p: DecodeParams) -> str:
    return f"k{p.slot_size}b{p.serial_num_blocks}s{p.slot_threshold:g}t{p.token_threshold:g}"


# ----------------------------------------------------------------------------- methods


@dataclass
class Sample:
    """One method on one prompt."""

    token_ids: list[int]  # every committed id in position order (the reference's reading: past the EOS too)
    tokens: int  # through the first EOS
    forwards: dict[str, int]
    wall: float
    engine: float
    tpf: float
    fed: int = 0  # tokens fed through the network, summed over forwards (batch x seq)
    text: str = ""
    correct: bool = False

    @property
    def forward_count(self) -> int:
        return sum(self.forwards.values())


@dataclass
class Method:
    id: str
    family: str  # ar | refusion | diffusion | reference-refusion | reference-ar
    label: str
    backend: str
    params: dict[str, Any]
    run: Callable[[list[int]], Sample] = field(repr=False)
    short: str = ""


class TorchReference:
    """The PyTorch reference loop (tools/bench/reference.py) over HF transformers, with time inside forwards."""

    def __init__(self, checkpoint: Path, threads: int):
        try:
            import torch
            from transformers import Qwen3ForCausalLM
        except ImportError as e:
            raise RefusionError("the PyTorch reference needs torch and transformers (pip install 'refusion-trt[export,dev]'), "
                                "or pass --no-reference.") from e
        from refusion.tools.bench import reference

        torch.set_num_threads(threads)
        self.torch = torch
        self.ref = reference
        self.model = Qwen3ForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
        self.engine_seconds = 0.0
        self.fed = 0
        inner = self.model.forward

        def timed(*args: Any, **kwargs: Any) -> Any:
            ids = kwargs.get("input_ids", args[0] if args else None)
            if ids is not None:
                self.fed += int(ids.numel())
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.engine_seconds += time.perf_counter() - t0

        self.model.forward = timed  # nn.Module.__call__ calls self.forward

    def refusion(self, ids: list[int], p: DecodeParams, mask_id: int, eos_id: int) -> tuple[list[int], dict[str, int], float]:
        res = self.ref.refusion_generate(
            self.model, ids, gen_length=p.gen_length, slot_size=p.slot_size, serial_num_blocks=p.serial_num_blocks,
            slot_threshold=p.slot_threshold, token_threshold=p.token_threshold, mask_id=mask_id, eos_id=eos_id)
        return list(res.token_ids), {k: v for k, v in res.forwards.items() if v}, float(res.tpf)

    def ar(self, ids: list[int], gen_length: int, eos_id: int) -> tuple[list[int], dict[str, int], float]:
        out = self.ref.ar_generate(self.model, ids, max_new_tokens=gen_length, eos_id=eos_id)
        return out, {"prefill": 1, "decode": len(out) - 1}, 1.0


def build_methods(gen: Generator, settings: list[DecodeParams], diffusion: list[DiffusionParams], gen_length: int,
                  reference: TorchReference | None, reference_settings: str) -> list[Method]:
    mask_id, eos_id = gen.manifest.mask_token_id, gen.manifest.eos_token_id
    runner = gen.runner

    def runtime(params: DecodeParams | DiffusionParams) -> Callable[[list[int]], Sample]:
        """A strategy of the runtime, through the Generator's scheduler; fed tokens from its runner's stats."""
        def run(ids: list[int]) -> Sample:
            fed = runner.stats.total.fed
            result = gen.submit_ids(ids, params).result()
            s = result.stats
            return Sample(result.committed_ids, s.tokens, dict(s.forwards), s.wall_seconds, s.runner_seconds, s.tpf,
                          runner.stats.total.fed - fed)
        return run

    def torch_run(fn: Callable[[list[int]], tuple[list[int], dict[str, int], float]]) -> Callable[[list[int]], Sample]:
        assert reference is not None

        def run(ids: list[int]) -> Sample:
            e0, f0 = reference.engine_seconds, reference.fed
            t0 = time.perf_counter()
            out, forwards, tpf = fn(ids)
            wall = time.perf_counter() - t0
            return Sample(out, len(through_eos(out, eos_id)), forwards, wall, reference.engine_seconds - e0, tpf,
                          reference.fed - f0)
        return run

    ar_params = DecodeParams(gen_length=gen_length, mode="ar")
    methods = [Method("ar", "ar", "AR (greedy)", runner.name, {"mode": "ar", "gen_length": gen_length},
                      runtime(ar_params), short="ar")]
    for p in settings:
        methods.append(Method(f"refusion:{_refusion_id(p)}", "refusion", refusion_label(p), runner.name,
                              _params_json(p), runtime(p), short=f"rf-{_refusion_id(p)}"))
    for d in diffusion:
        d_id = f"diffusion:s{d.steps}b{d.block_length}{'x' if d.early_exit else ''}{'c' if d.order == 'clean_first' else ''}"
        methods.append(Method(d_id, "diffusion", d.label(), runner.name,
                              {"gen_length": d.gen_length, "steps": d.steps, "block_length": d.block_length,
                               "order": d.order, "early_exit": d.early_exit},
                              runtime(d), short="llada-" + d_id.split(":")[1]))
    if reference is not None:
        chosen = settings if reference_settings == "all" else settings[:1]
        for p in chosen:
            methods.append(Method(f"reference-refusion:{_refusion_id(p)}", "reference-refusion", refusion_label(p), "torch",
                                  _params_json(p),
                                  torch_run(functools.partial(reference.refusion, p=p, mask_id=mask_id, eos_id=eos_id)),
                                  short=f"ref-{_refusion_id(p)}"))
        methods.append(Method("reference-ar", "reference-ar", "AR (greedy)", "torch",
                              {"mode": "ar", "gen_length": gen_length},
                              torch_run(lambda ids: reference.ar(ids, gen_length, eos_id)), short="ref-ar"))
    dup = [i for i, c in Counter(m.id for m in methods).items() if c > 1]
    if dup:
        raise RefusionError(f"setting {dup[0]!r} is given twice; each --settings / --diffusion entry must differ.")
    return methods


def _params_json(p: DecodeParams) -> dict[str, Any]:
    return {"gen_length": p.gen_length, "slot_size": p.slot_size, "serial_num_blocks": p.serial_num_blocks,
            "slot_threshold": p.slot_threshold, "token_threshold": p.token_threshold, "mode": p.mode,
            **({"upstream_eos_drop": True} if p.upstream_eos_drop else {})}


# ----------------------------------------------------------------------------- the run


@dataclass
class BenchConfig:
    model: Path
    n: int = 200
    seed: int = T.HELD_OUT_SEED
    threads: int = 1
    gen_length: int = DEFAULT_GEN_LENGTH
    settings: str = DEFAULT_SETTINGS
    diffusion: str = DEFAULT_DIFFUSION
    reference: bool = True
    reference_settings: str = "all"  # all | first
    upstream_eos_drop: bool = False  # our ReFusion drops slots after an EOS as upstream (and the reference) does
    warmup: int = 2
    out: Path | None = Path("results/bench")
    plot: bool = True
    profile: bool = False


def run_bench(cfg: BenchConfig, progress: Progress = echo_progress) -> dict[str, Any]:
    """Run the benchmark; write bench.md / bench.json / bench.png into cfg.out (if set); return the report."""
    if cfg.threads < 1:
        raise RefusionError(f"--threads {cfg.threads} must be >= 1 (the same count is used by onnxruntime and torch).")
    if cfg.reference_settings not in ("first", "all"):
        raise RefusionError(f"reference_settings={cfg.reference_settings!r} is not 'first' or 'all'.")
    try:
        examples = T.held_out(cfg.n + cfg.warmup, seed=cfg.seed)
    except ValueError as e:
        raise RefusionError(str(e)) from e
    if cfg.n < 1:
        raise RefusionError("--n must be at least 1.")
    settings = parse_settings(cfg.settings, cfg.gen_length, cfg.upstream_eos_drop)
    diffusion = parse_diffusion(cfg.diffusion, cfg.gen_length)
    if not settings:
        raise RefusionError("--settings is empty; give at least one ReFusion setting.")
    bench, warm = examples[: cfg.n], examples[cfg.n:]
    with tempfile.TemporaryDirectory(prefix="refusion-bench-") as tmp:
        export_dir, ckpt = resolve_model(cfg.model, Path(tmp), progress)
        reference = None
        if cfg.reference:
            if ckpt is None:
                raise RefusionError(f"{cfg.model} is an export whose source checkpoint is not here; pass the checkpoint "
                                    "directory for the PyTorch reference, or --no-reference.")
            reference = TorchReference(ckpt, cfg.threads)
        # Decoding speed: every prompt prefilled, as each method's first request (warm-up and method share prompts).
        with Generator.from_dir(export_dir, backend="ort-cpu", threads=cfg.threads, prefix_cache_mb=0) as gen:
            methods = build_methods(gen, settings, diffusion, cfg.gen_length, reference, cfg.reference_settings)
            line(progress, f"{len(methods)} methods x {cfg.n} prompts, {cfg.threads} thread(s), gen_length "
                           f"{cfg.gen_length}; warm-up on {len(warm)} other prompt(s)")
            prompts = [gen.prompt_ids(ex.prompt, chat=True) for ex in examples]
            runs = len(warm) * len(methods)
            for i, ids in enumerate(prompts[cfg.n:]):
                for j, m in enumerate(methods, 1):
                    m.run(ids)
                    tick(progress, "warm-up", i * len(methods) + j, runs, "run")
            eos = gen.manifest.eos_token_id

            def score(ex: T.Example, s: Sample) -> None:
                s.text = gen.tokenizer.decode(through_eos(s.token_ids, eos)) if gen.tokenizer else ""
                s.correct = T.score(ex, s.text)

            samples = run_interleaved(methods, bench, prompts[: cfg.n], score, progress)
            profile_text = profile_refusion(gen, prompts[: cfg.n], settings[0]) if cfg.profile else None
        report = make_report(cfg, methods, samples, bench, export_dir, ckpt, gen_manifest_model(export_dir))
    if profile_text is not None:
        report["profile"] = profile_text
    if cfg.out is not None:
        write_outputs(report, Path(cfg.out), plot=cfg.plot, progress=progress)
    return report


def run_interleaved(methods: list[Method], examples: list[T.Example], prompts: list[list[int]],
                    score: Callable[[T.Example, Sample], None], progress: Progress) -> dict[str, list[Sample]]:
    """Every method on every prompt; prompt i runs the methods starting from method i mod M (a
    rotation), so no method always runs first or right after the same neighbour."""
    samples: dict[str, list[Sample]] = {m.id: [] for m in methods}
    t_start = time.perf_counter()
    runs = len(prompts) * len(methods)  # the bar's unit: one method on one prompt
    for i, (ex, ids) in enumerate(zip(examples, prompts)):
        r = i % len(methods)
        for j, m in enumerate(methods[r:] + methods[:r], 1):
            s = m.run(ids)
            score(ex, s)
            samples[m.id].append(s)
            if j < len(methods):
                tick(progress, "bench", i * len(methods) + j, runs, "run")
        line(progress, f"[{i + 1}/{len(prompts)}] accuracy " + " | ".join(
             f"{m.short} {100 * np.mean([s.correct for s in samples[m.id]]):.0f}%" for m in methods)
             + f"  ({time.perf_counter() - t_start:.0f}s)", "bench", (i + 1) * len(methods), runs, "run")
    return samples


def gen_manifest_model(export_dir: Path) -> dict[str, Any]:
    manifest = ExportManifest.read(Path(export_dir))
    return {"dims": {"architecture": "Qwen3ForCausalLM", **manifest.dims.to_json()}, "dtype": manifest.dtype}


# ----------------------------------------------------------------------------- aggregation


def summarize(samples: list[Sample], examples: list[T.Example]) -> dict[str, Any]:
    tokens = sum(s.tokens for s in samples)
    forwards = sum(s.forward_count for s in samples)
    wall = sum(s.wall for s in samples)
    engine = sum(s.engine for s in samples)
    fed = sum(s.fed for s in samples)
    by_kind: Counter = Counter()
    for s in samples:
        by_kind.update(s.forwards)
    hits: dict[str, list[bool]] = defaultdict(list)
    for s, ex in zip(samples, examples):
        hits[ex.task].append(s.correct)
    return {
        "n": len(samples),
        "correct": int(sum(s.correct for s in samples)),
        "accuracy": float(np.mean([s.correct for s in samples])),
        "accuracy_by_task": {t: float(np.mean(v)) for t, v in hits.items()},
        "tokens": tokens,
        "forwards": forwards,
        "forwards_by_kind": dict(by_kind),
        "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "tpf": float(np.mean([s.tpf for s in samples])),
        "tokens_per_second": tokens / wall if wall else 0.0,
        "forwards_per_second": forwards / wall if wall else 0.0,
        "wall_seconds": wall,
        "ms_per_prompt": 1000 * wall / len(samples),
        "engine_seconds": engine,
        "loop_seconds": wall - engine,
        "engine_share": engine / wall if wall else 0.0,
        "engine_ms_per_forward": 1000 * engine / forwards if forwards else 0.0,
        "loop_ms_per_forward": 1000 * (wall - engine) / forwards if forwards else 0.0,
        "fed_tokens_per_forward": fed / forwards if forwards else 0.0,
        "fed_tokens_per_token": fed / tokens if tokens else 0.0,
    }


def speedup(a: list[Sample], b: list[Sample], rng: np.random.Generator, draws: int = BOOTSTRAP) -> dict[str, Any]:
    """tokens/s of a over tokens/s of b on the same prompts, with a bootstrap 95% interval over prompts."""
    ta, wa = np.array([s.tokens for s in a], float), np.array([s.wall for s in a])
    tb, wb = np.array([s.tokens for s in b], float), np.array([s.wall for s in b])
    ratio = float((ta.sum() / wa.sum()) / (tb.sum() / wb.sum()))
    idx = rng.integers(0, len(a), (draws, len(a)))
    boot = (ta[idx].sum(1) / wa[idx].sum(1)) / (tb[idx].sum(1) / wb[idx].sum(1))
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"ratio": ratio, "ci95": [float(lo), float(hi)]}


def make_report(cfg: BenchConfig, methods: list[Method], samples: dict[str, list[Sample]], examples: list[T.Example],
                export_dir: Path, ckpt: Path | None, model_info: dict[str, Any]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    by_id = {m.id: m for m in methods}
    diffusion_ids = [m.id for m in methods if m.family == "diffusion"]
    base_diffusion = diffusion_ids[0] if diffusion_ids else None
    rows = []
    for m in methods:
        summary = summarize(samples[m.id], examples)
        ratios: dict[str, Any] = {}
        if m.id != "ar":
            ratios["vs_ar"] = speedup(samples[m.id], samples["ar"], rng)
        if base_diffusion and m.id != base_diffusion:
            ratios["vs_diffusion"] = speedup(samples[m.id], samples[base_diffusion], rng)
        ref_id = _reference_of(m, by_id)
        if ref_id:
            ratios["vs_reference"] = speedup(samples[m.id], samples[ref_id], rng)
            same = sum(a.token_ids == b.token_ids for a, b in zip(samples[m.id], samples[ref_id]))
            ratios["reference"] = ref_id
            summary["same_tokens_as_reference"] = same
        rows.append({"id": m.id, "family": m.family, "method": _FAMILY_NAMES[m.family], "setting": m.label,
                     "backend": m.backend, "params": m.params, **summary, "ratios": ratios})
    report = {
        "meta": {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": str(cfg.model), "export_dir": str(export_dir) if (Path(cfg.model) / MANIFEST_NAME).is_file() else None,
            "checkpoint": str(ckpt) if ckpt else None, **model_info,
            "n": cfg.n, "held_out_seed": cfg.seed, "held_out_sha256": prompts_digest(examples), "threads": cfg.threads, "gen_length": cfg.gen_length,
            "warmup_prompts": cfg.warmup, "settings": cfg.settings, "diffusion": cfg.diffusion,
            "reference": cfg.reference, "reference_settings": cfg.reference_settings,
            "backend": "ort-cpu", "decoding": "greedy (temperature 0)",
            "tokens": "generated tokens in position order through the first EOS",
            "ratios": "tokens/s over tokens/s from interleaved runs on the same prompts; ci95 = bootstrap over prompts",
            "host": host_info(),
            "command": reproduce_command(cfg),
        },
        "methods": rows,
        "comparisons": comparisons(rows),
        "per_prompt": {
            "tasks": [ex.task for ex in examples],
            **{m.id: {"correct": [int(s.correct) for s in samples[m.id]], "tokens": [s.tokens for s in samples[m.id]],
                      "forwards": [s.forward_count for s in samples[m.id]],
                      "wall_ms": [round(1000 * s.wall, 4) for s in samples[m.id]],
                      "engine_ms": [round(1000 * s.engine, 4) for s in samples[m.id]]} for m in methods},
        },
    }
    return report


_FAMILY_NAMES = {
    "ar": "AR (runtime)",
    "refusion": "ReFusion (runtime)",
    "diffusion": "LLaDA-style diffusion (runtime, no KV reuse)",
    "reference-refusion": "ReFusion (PyTorch reference)",
    "reference-ar": "AR (PyTorch reference)",
}


def _reference_of(m: Method, by_id: dict[str, Method]) -> str | None:
    if m.family == "refusion":
        ref = "reference-" + m.id
        return ref if ref in by_id else None
    if m.family == "ar":
        return "reference-ar" if "reference-ar" in by_id else None
    return None


def comparisons(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """ReFusion against AR, LLaDA-style diffusion and the PyTorch reference on this run: the ratios and what
    they are made of. (The project's targets for them live in docs/benchmark.md, not in what the bench prints.)"""
    ar = next(r for r in rows if r["id"] == "ar")
    rf = [r for r in rows if r["family"] == "refusion"]
    out: dict[str, Any] = {"refusion_vs_ar": {"settings": [
        {"id": r["id"], "setting": r["setting"], "speedup_vs_ar": r["ratios"]["vs_ar"]["ratio"],
         "accuracy_delta_points": 100 * (r["accuracy"] - ar["accuracy"]),
         # speedup = (tokens/forward ratio) x (forwards/s ratio)
         "tokens_per_forward_ratio": r["tokens_per_forward"] / ar["tokens_per_forward"],
         "forward_speed_ratio": r["forwards_per_second"] / ar["forwards_per_second"]} for r in rf]}}
    if any("vs_diffusion" in r["ratios"] for r in rf):
        out["refusion_vs_diffusion"] = {
            "settings": [{"id": r["id"], "speedup": r["ratios"]["vs_diffusion"]["ratio"],
                          "ci95": r["ratios"]["vs_diffusion"]["ci95"]} for r in rf],
        }
    refs = [r for r in rows if "vs_reference" in r["ratios"]]
    if refs:
        out["runtime_vs_reference"] = {
            "settings": [{"id": r["id"], "speedup": r["ratios"]["vs_reference"]["ratio"],
                          "ci95": r["ratios"]["vs_reference"]["ci95"],
                          "same_tokens": f"{r['same_tokens_as_reference']}/{r['n']}"} for r in refs],
        }
    return out


def reproduce_command(cfg: BenchConfig) -> str:
    parts = [f"refusion-run bench {cfg.model}", f"--n {cfg.n}", f"--threads {cfg.threads}", f"--gen-length {cfg.gen_length}",
             f'--settings "{cfg.settings}"', f'--diffusion "{cfg.diffusion}"', f"--warmup {cfg.warmup}"]
    if not cfg.reference:
        parts.append("--no-reference")
    elif cfg.reference_settings != "all":
        parts.append(f"--reference-settings {cfg.reference_settings}")
    if cfg.upstream_eos_drop:
        parts.append("--upstream-eos-drop")
    if cfg.out is not None:
        parts.append(f"--out {cfg.out}")
    return " ".join(parts)


# ----------------------------------------------------------------------------- outputs


def _ratio(r: dict[str, Any], key: str) -> str:
    v = r["ratios"].get(key)
    if not v:
        return "1" if (key == "vs_ar" and r["id"] == "ar") else ""
    lo, hi = v["ci95"]
    return f"{v['ratio']:.2f}x ({lo:.2f}-{hi:.2f})"


def render_markdown(report: dict[str, Any]) -> str:
    meta, rows = report["meta"], report["methods"]
    host = meta["host"]
    dims = meta.get("dims", {})
    lines = [
        "# refusion-run bench",
        "",
        f"Model `{meta['model']}` ({dims.get('num_layers', '?')} layers, hidden {dims.get('hidden_size', '?')}, "
        f"{meta.get('dtype')}), {meta['n']} held-out prompts (seed {meta['held_out_seed']}, "
        f"sha256 {meta.get('held_out_sha256')}), gen_length "
        f"{meta['gen_length']}, greedy, {meta['threads']} thread(s) for onnxruntime and torch alike, "
        f"{meta['warmup_prompts']} warm-up prompt(s); {host.get('processor')}, {host.get('cpu_count')} CPUs, "
        f"onnxruntime {host.get('onnxruntime', '?')}, torch {host.get('torch', '-')}; {meta['date']}.",
        "Tokens = generated tokens through the first EOS (all methods alike). Ratios are tokens/s over tokens/s from "
        "runs interleaved prompt by prompt in one process (order rotated), with a bootstrap 95% interval over prompts. "
        "LLaDA-style ratios are against the first diffusion row.",
        "",
        "| method | setting | accuracy | tokens/forward | TPF | tokens/s | wall (s) | engine share | vs AR | vs LLaDA-style | vs PyTorch ref |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['setting']} | {100 * r['accuracy']:.1f}% | {r['tokens_per_forward']:.2f} | "
            f"{r['tpf']:.2f} | {r['tokens_per_second']:.0f} | {r['wall_seconds']:.1f} | {100 * r['engine_share']:.0f}% | "
            f"{_ratio(r, 'vs_ar')} | {_ratio(r, 'vs_diffusion')} | {_ratio(r, 'vs_reference')} |")
    lines += [
        "",
        "Where the time goes (per forward; fed = tokens fed through the network, batch x sequence):",
        "",
        "| method | setting | forwards/prompt | fed tokens/forward | fed tokens/generated token | engine ms/forward | loop ms/forward | ms/prompt |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['setting']} | {r['forwards'] / r['n']:.1f} | {r['fed_tokens_per_forward']:.1f} | "
            f"{r['fed_tokens_per_token']:.1f} | {r['engine_ms_per_forward']:.3f} | {r['loop_ms_per_forward']:.3f} | "
            f"{r['ms_per_prompt']:.1f} |")
    tasks_ = list(dict.fromkeys(report["per_prompt"]["tasks"]))
    lines += ["", "Accuracy by task:", "", "| method | setting | " + " | ".join(tasks_) + " |",
              "|---|---|" + "---|" * len(tasks_)]
    for r in rows:
        lines.append(f"| {r['method']} | {r['setting']} | "
                     + " | ".join(f"{100 * r['accuracy_by_task'].get(t, float('nan')):.0f}" for t in tasks_) + " |")
    lines += ["", "## ReFusion against the other methods", ""]
    c = report["comparisons"]
    rv = c["refusion_vs_ar"]["settings"]
    lines.append("- Against AR, tokens/s and accuracy: "
                 + "; ".join(f"{p['setting']}: {p['speedup_vs_ar']:.2f}x, {p['accuracy_delta_points']:+.1f} points"
                             for p in rv) + ".")
    lines.append("  Speedup vs AR = tokens/forward ratio x forward-speed ratio: "
                 + "; ".join(f"{p['setting']}: {p['tokens_per_forward_ratio']:.2f} x {p['forward_speed_ratio']:.2f}"
                             for p in rv) + ".")
    if "refusion_vs_diffusion" in c:
        lines.append("- Against LLaDA-style token-level diffusion, tokens/s: "
                     + "; ".join(f"{s['id'].split(':', 1)[1]} {s['speedup']:.1f}x"
                                 for s in c["refusion_vs_diffusion"]["settings"]) + ".")
    if "runtime_vs_reference" in c:
        lines.append("- The runtime against the PyTorch reference loop (same checkpoint and threads), tokens/s: "
                     + "; ".join(f"{s['id']}: {s['speedup']:.2f}x (same tokens {s['same_tokens']})"
                                 for s in c["runtime_vs_reference"]["settings"]) + ".")
    lines += ["", f"Reproduce: `{meta['command']}`", ""]
    return "\n".join(lines)


_STYLE = {
    "ar": ("tab:blue", "s"),
    "refusion": ("tab:red", "o"),
    "diffusion": ("tab:green", "^"),
    "reference-refusion": ("tab:purple", "D"),
    "reference-ar": ("tab:gray", "v"),
}


def short_label(r: dict[str, Any]) -> str:
    p = r["params"]
    if r["family"] in ("ar", "reference-ar"):
        return "AR" + (" (torch)" if r["family"] == "reference-ar" else "")
    if r["family"] == "diffusion":
        return f"LLaDA-style s{p['steps']} b{p['block_length']}" + (" exit" if p["early_exit"] else "") + (
            " clean" if p["order"] == "clean_first" else "")
    label = f"k{p['slot_size']} b{p['serial_num_blocks']} {p['slot_threshold']:g}/{p['token_threshold']:g}"
    return label + (" (torch)" if r["family"] == "reference-refusion" else "")


def render_plot(report: dict[str, Any], path: Path) -> None:
    """Accuracy against tokens/s (log x), one numbered point per method and setting, with a key."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["methods"]
    fig, ax = plt.subplots(figsize=(12, 6.5), dpi=120)
    seen = set()
    offsets = [(5, 5), (5, -12), (-12, 5), (-12, -12)]  # stagger the numbers of neighbouring points
    by_speed = sorted(range(len(rows)), key=lambda i: rows[i]["tokens_per_second"])
    stagger = {i: offsets[j % len(offsets)] for j, i in enumerate(by_speed)}
    key = []
    for i, r in enumerate(rows):
        color, marker = _STYLE[r["family"]]
        x, y = max(r["tokens_per_second"], 1e-9), 100 * r["accuracy"]
        ax.scatter([x], [y], c=color, marker=marker, s=60, zorder=3,
                   label=None if r["family"] in seen else r["method"])
        seen.add(r["family"])
        ax.annotate(str(i + 1), (x, y), textcoords="offset points", xytext=stagger[i], fontsize=8, color=color,
                    fontweight="bold")
        key.append(f"{i + 1:>2} {short_label(r)}: {y:.1f}%, {r['tokens_per_second']:.0f} tok/s")
    ax.set_xscale("log")
    xs = [max(r["tokens_per_second"], 1e-9) for r in rows]
    ys = [100 * r["accuracy"] for r in rows]
    ax.set_xlim(min(xs) / 1.5, max(xs) * 1.5)
    ax.set_ylim(max(0.0, min(ys) - 8), min(100.0, max(ys) + 8) if max(ys) - min(ys) < 84 else 100.0)
    ax.set_xlabel("tokens / s (log scale)")
    ax.set_ylabel("exact-match accuracy (%)")
    meta = report["meta"]
    model = Path(meta["model"])
    name = model.parent.name if model.name in ("model", "onnx") else model.name
    ax.set_title(f"accuracy vs tokens/s: {name}, {meta['n']} held-out prompts, {meta['threads']} CPU thread(s)")
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = {name: i for i, name in enumerate(_FAMILY_NAMES.values())}
    pairs = sorted(zip(handles, labels), key=lambda hl: order.get(hl[1], 99))
    ax.legend([h for h, _ in pairs], [lbl for _, lbl in pairs], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    ax.text(1.01, 0.0, "\n".join(key), transform=ax.transAxes, fontsize=7, family="monospace", va="bottom", ha="left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_outputs(report: dict[str, Any], out: Path, plot: bool = True, progress: Progress = echo_progress) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({k: v for k, v in report.items() if k != "profile"}, indent=1) + "\n")
    (out / "bench.md").write_text(render_markdown(report))
    if "profile" in report:
        (out / "profile.txt").write_text(report["profile"])
    written = ["bench.md", "bench.json"]
    if plot:
        try:
            render_plot(report, out / "bench.png")
            written.append("bench.png")
        except ImportError:
            line(progress, "warning: matplotlib is not installed; bench.png not written (pip install matplotlib)")
    line(progress, f"wrote {', '.join(str(out / w) for w in written)}")


# ----------------------------------------------------------------------------- profile


def profile_refusion(gen: Generator, prompts: list[list[int]], params: DecodeParams, top: int = 25) -> str:
    """cProfile of ReFusion decoding over `prompts` on the scheduler thread, where the loop runs: the runner
    vs the loop, and the loop's hottest functions."""
    runner0 = gen.runner.stats.busy_seconds
    prof = gen.scheduler.profiler = cProfile.Profile()
    t0 = time.perf_counter()
    try:
        tokens = sum(gen.submit_ids(ids, params).result().stats.tokens for ids in prompts)
    finally:
        gen.scheduler.profiler = None
    wall = time.perf_counter() - t0
    engine = gen.runner.stats.busy_seconds - runner0
    return profile_report(prof, f"ReFusion {refusion_label(params)} over {len(prompts)} prompts under cProfile: "
                          f"wall {wall:.3f} s, engine (Runner.run/move_kv) {engine:.3f} s ({100 * engine / wall:.0f}%), "
                          f"loop {wall - engine:.3f} s; {tokens} tokens (profiler overhead inflates the loop share)", top)


# ----------------------------------------------------------------------------- CLI


@click.command("bench")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--n", type=int, default=200, show_default=True, help="Held-out prompts (the first n of the fixed set).")
@click.option("--seed", type=int, default=T.HELD_OUT_SEED, show_default=True, help="Held-out set seed (there is one).")
@click.option("--threads", type=int, default=1, show_default=True,
              help="onnxruntime intra-op threads and torch threads, the same for every method.")
@click.option("--gen-length", type=int, default=DEFAULT_GEN_LENGTH, show_default=True)
@click.option("--settings", default=DEFAULT_SETTINGS, show_default=True,
              help="ReFusion settings 'slot_size,serial_num_blocks,slot_threshold,token_threshold;...'.")
@click.option("--diffusion", default=DEFAULT_DIFFUSION, show_default=True,
              help="LLaDA-style settings 'steps,block_length[,exit][,clean];...' (exit: stop once the answer is settled; "
                   "clean: committed tokens fed before the masks); the first is the baseline of the ratios.")
@click.option("--reference/--no-reference", default=True, show_default=True,
              help="Also run the PyTorch reference loop (needs the checkpoint, torch, transformers).")
@click.option("--reference-settings", type=click.Choice(["all", "first"]), default="all", show_default=True,
              help="The ReFusion settings the PyTorch reference runs: every one, or the first.")
@click.option("--upstream-eos-drop", is_flag=True,
              help="Our ReFusion drops the slots after an EOS found in infill as upstream (and the PyTorch reference) "
                   "does, holes included, so its tokens compare with the reference's on every prompt (default: every "
                   "position before the EOS decoded; docs/decoding.md).")
@click.option("--warmup", type=int, default=2, show_default=True, help="Warm-up prompts (not scored), every method.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench"), show_default=True)
@click.option("--no-plot", is_flag=True, help="Skip bench.png.")
@click.option("--profile", is_flag=True, help="Also cProfile ReFusion (first setting) on the prompts: OUT/profile.txt.")
@quiet_option
def bench(model: Path, n: int, seed: int, threads: int, gen_length: int, settings: str, diffusion: str, reference: bool,
          reference_settings: str, upstream_eos_drop: bool, warmup: int, out: Path, no_plot: bool,
          profile: bool) -> None:
    """Accuracy and tokens/s of AR, ReFusion, LLaDA-style diffusion and the PyTorch reference on MODEL
    (a checkpoint directory, exported to a temporary directory, or an export directory)."""
    report = run_bench(BenchConfig(model=model, n=n, seed=seed, threads=threads, gen_length=gen_length,
                                   settings=settings, diffusion=diffusion, reference=reference,
                                   reference_settings=reference_settings, upstream_eos_drop=upstream_eos_drop,
                                   warmup=warmup, out=out,
                                   plot=not no_plot, profile=profile))
    click.echo(render_markdown(report))
