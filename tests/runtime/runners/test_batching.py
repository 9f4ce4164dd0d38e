"""Batched forwards on the GPU runners, on the CPU fakes: profiles with a batch dimension
(`--max-batch`), engines.json v3 and its refusals, the TensorRT runner's gather / scatter of
several requests' KV, and the onnxruntime CUDA runner's batched IO binding.

The oracle is each request decoded alone on the same runner (one slot, no engine): every
greedy request served beside others, its forwards packed with theirs, must get those tokens.
The cancelled neighbour is held mid-decode by tests/gate.py; the `timeout=`s only guard against a hang.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from refusion.runtime.core.engines_manifest import FORMAT_VERSION, EngineManifest
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DecodeLimits, engine_profiles, select_profile
from refusion.runtime.decode import masks
from refusion.runtime.generator import Generator
from refusion.runtime.runners.base import Runner
from refusion.runtime.runners.rows import RowFeed
from refusion.runtime.runners.tensorrt import TensorRTRunner
from tests.fakes import CpuBoundCudaRunner
from tests.gate import ForwardGate
from tests.helpers import MIXED_SETTINGS, chat_jobs, decode_alone_on, fake_engines

pytest.importorskip("onnxruntime")  # the fakes run the graphs on it
pytest.importorskip("torch")  # chat_jobs' held-out prompts

# The embedded model's chat prompts are 18-51 tokens; blocks up to the whole generation (serial_num_blocks 1).
LIMITS = DecodeLimits(max_prompt=64, gen_length=64, slot_size=4, serial_blocks=1, max_batch=4)
@pytest.fixture(scope="module")
def jobs(tiny_export) -> list[tuple[list[int], dict]]:
    return chat_jobs(tiny_export, 12, MIXED_SETTINGS)


def count_packed(runner: Runner, method: str) -> list[int]:
    """Rows of every packed call of `runner.<method>(graph, rows)` (the runner's batched path)."""
    sizes: list[int] = []
    real = getattr(runner, method)
    setattr(runner, method, lambda graph, *args: sizes.append(len(args[-1])) or real(graph, *args))
    return sizes


def serve_together(runner: Runner, manifest: ExportManifest, jobs: list, victim: list[int] | None = None) -> list:
    """Every job submitted at once to one Generator over `runner`; `victim`: a long AR request
    submitted first and cancelled after its first commit, while the others run beside it."""
    gen = Generator(manifest, runner, None)
    try:
        with ForwardGate(runner) as gate:  # nothing runs until every request is in
            cancelled = gen.submit(prompt_ids=victim, gen_length=64, mode="ar") if victim else None
            requests = [gen.submit(prompt_ids=ids, **settings) for ids, settings in jobs]
            if cancelled is not None:
                gate.hold_when(lambda: cancelled.commits)
                gate.wait_held()  # its first commit is in, its next forward held: it cannot end on its own
                cancelled.cancel()
        if cancelled is not None:
            assert cancelled.result(timeout=60).finish_reason == "cancelled"
        results = [r.result(timeout=120) for r in requests]
        assert gen.scheduler.in_flight == 0 and sorted(gen.scheduler._free_regions) == list(range(runner.max_requests))
        return results
    finally:
        gen.scheduler.close()


# -- profiles, the build flag, engines.json --------------------------------------------------------
def test_profiles_gain_a_batch_dimension_for_decode_forwards():
    prefill, decode, plan = engine_profiles(DecodeLimits(max_batch=8))
    assert prefill.batch == (1, 1, 1)  # prefills stay one at a time (the largest activations)
    assert decode.batch == plan.batch == (1, 4, 8)
    assert [p.batch for p in engine_profiles(DecodeLimits())] == [(1, 1, 1)] * 3  # the v2 engines, unchanged
    profiles = engine_profiles(DecodeLimits(max_batch=8))
    assert select_profile(profiles, "infiller", 32, 1500, batch=8) == 1
    assert select_profile(profiles, "infiller", 32, 1500, batch=9) is None
    assert select_profile(profiles, "infiller", 200, 0, batch=2) is None  # a batched prefill has no profile
    assert select_profile(profiles, "planner", 128, 1500, batch=5) == 2
    with pytest.raises(RefusionError, match="--max-batch 0 must be a positive integer"):
        DecodeLimits(max_batch=0)


def test_batch_ranges_reach_every_input_and_the_build_plan(exports, tmp_path):
    from refusion.engines.build import engine_loader, plan_build

    plan = plan_build(exports["fp16"], tmp_path / "engines", LIMITS)
    assert "--max-batch 4" in plan.command
    spec = plan.export.graphs["infiller"]
    config = engine_loader(plan)._config._config
    for polygraphy_profile, ours in zip(config.profiles, plan.profiles):
        for name, (lo, opt, hi) in ours.shapes(spec).items():  # every input's first axis is the batch
            shape = polygraphy_profile[name]
            assert (shape.min[0], shape.opt[0], shape.max[0]) == ours.batch, name
            assert (tuple(shape.min), tuple(shape.opt), tuple(shape.max)) == (lo, opt, hi)
    assert config.profiles[1]["past_key_values.0.key"].max[0] == 4


def test_build_flag(exports, tmp_path):
    from refusion.tools.build_command import build_command

    result = CliRunner().invoke(build_command, [str(exports["fp32"]), "-o", str(tmp_path / "e"), "--max-batch", "0"])
    assert isinstance(result.exception, RefusionError) and "--max-batch 0" in str(result.exception)
    assert "--max-batch" in CliRunner().invoke(build_command, ["--help"]).output


def test_engines_json_v3_round_trip_and_refusals(peaky_export, tmp_path):
    engines = fake_engines(peaky_export, tmp_path / "engines", DecodeLimits(max_prompt=16, gen_length=64, slot_size=4,
                                                                           serial_blocks=2, max_batch=4))
    file = engines / "engines.json"
    raw = json.loads(file.read_text())
    assert raw["format_version"] == FORMAT_VERSION == 3 and raw["limits"]["max_batch"] == 4
    m = EngineManifest.load(engines)
    assert m.limits.max_batch == 4 and [p.batch for p in m.engine.profiles] == [(1, 1, 1), (1, 2, 4), (1, 2, 4)]
    assert "--max-batch 4" in m.rebuild_command

    v2 = json.loads(file.read_text())  # what a v2 build wrote: no batch anywhere, every profile batch 1
    v2["format_version"] = 2
    del v2["limits"]["max_batch"]
    for profile in v2["engine"]["profiles"]:
        del profile["batch"]
    file.write_text(json.dumps(v2))
    old = EngineManifest.load(engines)
    assert old.limits.max_batch == 1 and all(p.batch == (1, 1, 1) for p in old.engine.profiles)

    v3_without_batch = {**v2, "format_version": 3}
    file.write_text(json.dumps(v3_without_batch))
    with pytest.raises(RefusionError, match=r"engines.json is damaged .*v3 records the batch dimension"):
        EngineManifest.load(engines)

    inconsistent = {**raw, "limits": {**raw["limits"], "max_batch": 8}}
    file.write_text(json.dumps(inconsistent))
    with pytest.raises(RefusionError, match=r"inconsistent: its limits say --max-batch 8 but its profiles take at most "
                                            r"4 rows.*Rebuild with: refusion-export build"):
        EngineManifest.load(engines)
    bad_range = json.loads(json.dumps(raw))
    bad_range["engine"]["profiles"][1]["batch"] = [2, 1, 4]
    file.write_text(json.dumps(bad_range))
    with pytest.raises(RefusionError, match=r"damaged .*batch \[2, 1, 4\] is not 1 <= min <= opt <= max"):
        EngineManifest.load(engines)


# -- packing -----------------------------------------------------------------------------------------
def test_packed_rows_keep_to_their_own_and_no_mask_row_is_empty():
    """Rows of 3 and 1 tokens over pasts 2 and 4: each real token's row of the mask is its own, and a
    padding token attends to itself alone (an all-masked row is NaN once the mask bias is half precision)."""
    from refusion.runtime.runners.rows import pack_rows

    rows = [RowFeed(np.array([[5, 6, 7]]), np.array([[2, 3, 4]]), masks.causal_after(2, 3), 2, 2, 0).with_heads(),
            RowFeed(np.array([[9]]), np.array([[4]]), masks.causal_after(4, 1), 4, 4, 1).with_heads()]
    packed = pack_rows(rows)
    assert (packed.seq, packed.past) == (3, 4) and packed.attention_mask.shape == (2, 3, 7)
    assert packed.attention_mask.any(axis=-1).all()
    np.testing.assert_array_equal(packed.attention_mask[0, :, :2], masks.causal_after(2, 3)[0, :, :2])
    assert not packed.attention_mask[0, :, 2:4].any()  # the padded past: seen by nobody
    np.testing.assert_array_equal(packed.attention_mask[0, :, 4:], np.tri(3, dtype=bool))
    np.testing.assert_array_equal(packed.attention_mask[1, 0], [True] * 4 + [True, False, False])
    np.testing.assert_array_equal(packed.attention_mask[1, 1:], [[False] * 5 + [True, False],
                                                                 [False] * 6 + [True]])  # padding: itself only


def _with_infinite_mask_bias(export, out):
    """A copy of `export` whose mask bias is -inf instead of float32's min: what the bias becomes when a build
    runs its select in half precision."""
    import shutil

    import onnx
    from onnx import numpy_helper

    shutil.copytree(export, out)
    for graph in ("planner", "infiller"):
        model = onnx.load(str(out / f"{graph}.onnx"), load_external_data=False)
        bias = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and not i.dims
                and numpy_helper.to_array(i) == np.finfo(np.float32).min]
        assert len(bias) == 1
        bias[0].raw_data = np.array(-np.inf, np.float32).tobytes()
        onnx.save(model, str(out / f"{graph}.onnx"))
    return out


def test_packed_padding_stays_finite_with_an_infinite_mask_bias(tiny_export, fakes, tmp_path):
    """Rows of 1, 3 and 5 tokens packed: with the bias at -inf an all-masked padding row would be NaN, its KV NaN in
    the next layer, and 0 x NaN the row's real tokens through P.V. Padding that attends to itself keeps all finite."""
    export = _with_infinite_mask_bias(tiny_export, tmp_path / "inf-bias")
    rng = np.random.default_rng(2)
    with TensorRTRunner.from_dir(fake_engines(export, tmp_path / "engines", LIMITS)) as trt:
        rows = []
        for region, seq in enumerate((1, 3, 5)):
            trt.allocate_kv(32, region)
            trt.run("infiller", rng.integers(0, 100, (1, 6)), np.arange(6)[None], masks.causal_after(0, 6), 0, 0,
                    region)
            rows.append(RowFeed(rng.integers(0, 100, (1, seq)), np.arange(6, 6 + seq)[None],
                                masks.causal_after(6, seq), 6, 6, region))
        for out in trt.run_batch("infiller", rows):
            assert all(np.isfinite(a).all() for a in out.values())
        for region, row in enumerate(rows):
            assert all(np.isfinite(a).all() for a in trt.kv_to_host(6, row.input_ids.shape[1], region).values())


def test_an_all_masked_row_is_refused(tiny_export):
    from refusion.runtime.runners.onnxruntime import OrtRunner

    with OrtRunner(ExportManifest.load(tiny_export), threads=1) as runner:
        runner.allocate_kv(8)
        mask = masks.causal_after(0, 3)
        mask[0, 1] = False
        with pytest.raises(RefusionError, match=r"attention_mask row 1 attends to nothing"):
            runner.run("infiller", np.zeros((1, 3), np.int64), np.arange(3)[None], mask, 0, 0)


def test_a_forward_over_a_region_never_allocated_is_refused(tiny_export):
    """A planner forward writes no KV and reads none at past 0, yet its pool region must exist: refused with the
    call to make, not an assertion or onnxruntime's missing inputs."""
    from refusion.runtime.runners.onnxruntime import OrtRunner

    with OrtRunner(ExportManifest.load(tiny_export), threads=1) as runner:
        with pytest.raises(RefusionError, match=r"KV region 0 holds no KV yet; allocate_kv\(\) with the request's"):
            runner.run("planner", np.zeros((1, 2), np.int64), np.arange(2)[None], masks.causal_after(0, 2), 0)
        runner.allocate_kv(8)
        assert runner.run("planner", np.zeros((1, 2), np.int64), np.arange(2)[None], masks.causal_after(0, 2),
                          0)["argmax_ids"].shape == (1, 2)


def test_the_every_token_mask_is_made_once_a_batch_size_and_read_only(tiny_export):
    """No guide: the runner feeds one all-ones vocab_mask per batch size, made once (not an np.full a forward)."""
    from refusion.runtime.runners.onnxruntime import OrtRunner

    with OrtRunner(ExportManifest.load(tiny_export), threads=1) as runner:
        runner.allocate_kv(8)
        ids, pos = np.zeros((1, 2), np.int64), np.arange(2)[None]
        feeds = [runner._feed(ids, pos, masks.causal_after(0, 2), np.arange(2)[None]) for _ in range(2)]
        mask = feeds[0]["vocab_mask"]
        assert mask is feeds[1]["vocab_mask"] and not mask.flags.writeable and (mask == 255).all()
        assert runner._feed(np.zeros((3, 2), np.int64), np.zeros((3, 2), np.int64), np.ones((3, 2, 2), bool),
                            np.zeros((3, 1), np.int64))["vocab_mask"].shape[0] == 3
        out = runner.run("infiller", ids, pos, masks.causal_after(0, 2), 0, 0)  # onnxruntime takes it as it is
        assert out["argmax_ids"].shape == (1, 2)

# -- the TensorRT runner ---------------------------------------------------------------------------
def test_runner_sizes_come_from_engines_json(peaky_export, fakes, tmp_path):
    batched = fake_engines(peaky_export, tmp_path / "b", DecodeLimits(max_prompt=16, gen_length=64, slot_size=4,
                                                                      serial_blocks=2, max_batch=4))
    runner = TensorRTRunner.from_dir(batched)
    assert (runner.max_batch, runner.max_requests) == (4, 4)
    assert (TensorRTRunner.from_dir(batched, max_requests=6, max_batch=2).max_batch, 6) == (2, 6)
    with pytest.raises(RefusionError, match=r"max_batch=8 exceeds the engine's --max-batch 4.*rebuild with "
                                            r"--max-batch 8: refusion-export build"):
        TensorRTRunner.from_dir(batched, max_batch=8)
    with pytest.raises(RefusionError, match="max_requests=2 is less than max_batch=3"):
        TensorRTRunner.from_dir(batched, max_requests=2, max_batch=3)
    assert (TensorRTRunner.from_dir(batched, max_requests=2).max_batch, 2) == (2, 2)  # the batch follows fewer regions
    with pytest.raises(RefusionError, match="max_batch=0 must be a positive integer"):
        TensorRTRunner.from_dir(batched, max_batch=0)
    single = TensorRTRunner.from_dir(fake_engines(peaky_export, tmp_path / "s"))
    assert (single.max_batch, single.max_requests) == (1, 1)


def test_packed_rows_equal_each_row_alone(tiny_export, fakes, tmp_path):
    """Rows of different lengths, pasts and slots in one execution give each row's own heads and
    present KV (written at its write_at in its region, odd offsets included). Within 1e-5, not bit for
    bit: the fake runs the graph on onnxruntime, which sums a padded batch in another order (as on the
    CPU runner, tests/runtime/test_concurrency.py). A planner batch leaves every region untouched. A
    prefill row beside them runs alone on the batch-1 prefill profile."""
    _, cudart = fakes
    engines = fake_engines(tiny_export, tmp_path / "engines", LIMITS)
    rng = np.random.default_rng(0)
    with TensorRTRunner.from_dir(engines) as trt:
        rows = []
        for region, (past, seq, write_at) in enumerate([(7, 3, 7), (12, 5, 13), (20, 1, 21)]):
            trt.allocate_kv(48, region)
            trt.run("infiller", rng.integers(0, 100, (1, past)), np.arange(past)[None],
                    masks.causal_after(0, past), 0, 0, region)
            rows.append(RowFeed(rng.integers(0, 100, (1, seq)), np.arange(past, past + seq)[None],
                                masks.causal_after(past, seq), past, write_at, region))
        before = [trt.kv_to_host(0, 48, s) for s in range(3)]
        alone = [trt.run_batch("infiller", [r])[0] for r in rows]
        kv_alone = [trt.kv_to_host(0, 48, s) for s in range(3)]
        for s, kv in enumerate(before):
            trt.kv_from_host(0, {name.replace("present", "past_key_values"): a for name, a in kv.items()}, s)
        decode = trt._contexts[1]
        runs = decode.runs
        packed = trt.run_batch("infiller", rows)
        assert decode.runs == runs + 1  # one execution for the three rows
        assert decode.shapes["past_key_values.0.key"][:2] == (3, 20)  # padded to the longest past
        for a, b in zip(alone, packed):
            assert a.keys() == b.keys()
            for name in a:
                np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-5)  # log-probabilities reach ~30
        for s in range(3):
            for name, array in trt.kv_to_host(0, 48, s).items():
                np.testing.assert_allclose(array, kv_alone[s][name], rtol=0, atol=1e-5)

        kv_packed = [trt.kv_to_host(0, 48, s) for s in range(3)]
        planner_rows = [RowFeed(r.input_ids, r.position_ids, r.attention_mask, r.past, None, r.region) for r in rows]
        plan = trt._contexts[2]
        out = trt.run_batch("planner", planner_rows)
        heads = {"argmax_ids", "argmax_probs", "top_ids", "top_logprobs"}
        assert plan.runs == 1 and [set(o) for o in out] == [heads] * 3
        for s in range(3):
            for name, array in trt.kv_to_host(0, 48, s).items():
                np.testing.assert_array_equal(array, kv_packed[s][name])

        prefill = RowFeed(rng.integers(0, 100, (1, 30)), np.arange(30)[None], masks.causal_after(0, 30), 0, 0, 3)
        trt.allocate_kv(48, 3)
        prefills = trt._contexts[0].runs
        trt.run_batch("infiller", [*rows[:2], prefill])
        assert trt._contexts[0].runs == prefills + 1 and decode.runs == runs + 2  # prefill alone, the others packed
        too_long = RowFeed(np.zeros((1, 70), np.int64), np.arange(5, 75)[None], masks.causal_after(5, 70), 5, None, 3)
        with pytest.raises(RefusionError, match=r"planner forward of 70 tokens over 5 past tokens lies outside"):
            trt.run_batch("planner", [planner_rows[0], too_long])
        assert plan.runs == 1  # refused before any row ran
    assert cudart.allocations == {}


def test_kv_copies_per_forward_are_counted(tiny_export, fakes, tmp_path):
    """RunnerStats counts each forward's KV copies. On the GPU runners a past bound in place and a present
    written in place copy nothing, a staged (unaligned) present is one copy, and a packed forward one copy a
    row each way, its pasts gathered and its presents scattered, whatever the layers; the CPU runner reads one
    row's past in place and copies its present in, one copy for every layer's K and V (a region is one array), and
    a packed forward's rows one copy a row each way."""
    from refusion.runtime.runners.onnxruntime import OrtRunner

    manifest = ExportManifest.load(tiny_export)
    caches, per_token = 2 * manifest.num_layers, TensorRTRunner.from_dir(fake_engines(
        tiny_export, tmp_path / "engines", LIMITS)).kv_bytes_per_token
    assert per_token // caches % 256  # 384-byte tokens: an odd write_at is unaligned, so TensorRT stages it
    rng = np.random.default_rng(3)
    spans = [(7, 3, 7), (12, 5, 13), (20, 1, 21)]  # (past, seq, write_at)
    pasts, seqs = sum(p for p, _, _ in spans), sum(q for _, q, _ in spans)
    runners = {"trt": TensorRTRunner.from_dir(tmp_path / "engines"),
               "ort-cuda": CpuBoundCudaRunner(manifest, threads=1, max_requests=3, max_batch=3),
               "ort-cpu": OrtRunner(manifest, threads=1, max_requests=3, max_batch=3)}
    for name, runner in runners.items():
        with runner:
            def counted(graph, rows):
                before = runner.stats.copy()
                runner.run_batch(graph, rows)
                done = runner.stats.since(before).graph(graph)
                return done.kv_copies, done.kv_copy_bytes

            rows = []
            for region, (past, seq, write_at) in enumerate(spans):
                runner.allocate_kv(48, region)
                prefill = RowFeed(rng.integers(0, 100, (1, past)), np.arange(past)[None], masks.causal_after(0, past),
                                  0, 0, region)
                lone = (1, per_token * past) if name == "ort-cpu" else (0, 0)
                assert counted("infiller", [prefill]) == lone, name
                rows.append(RowFeed(rng.integers(0, 100, (1, seq)), np.arange(past, past + seq)[None],
                                    masks.causal_after(past, seq), past, write_at, region))
            staged = {"trt": (1, per_token * 5), "ort-cuda": (0, 0), "ort-cpu": (1, per_token * 5)}[name]
            assert counted("infiller", [rows[1]]) == staged, name  # write_at 13: unaligned
            assert counted("infiller", rows) == (2 * 3, per_token * (pasts + seqs)), name
            planner = [RowFeed(r.input_ids, r.position_ids, r.attention_mask, r.past, None, r.region) for r in rows]
            assert counted("planner", planner) == (3, per_token * pasts), name


@pytest.mark.parametrize("max_requests, max_batch", [(4, 4), (6, 2)])
def test_requests_served_together_get_their_tokens_alone_on_tensorrt(tiny_export, jobs, fakes, tmp_path, max_requests,
                                                                     max_batch):
    """AR and ReFusion requests of several settings and prompt lengths, EOS early or never, one
    neighbour cancelled midway: each gets the tokens it gets alone on the same runner."""
    _, cudart = fakes
    engines = fake_engines(tiny_export, tmp_path / "engines", LIMITS)
    manifest = ExportManifest.read(engines)
    with TensorRTRunner.from_dir(engines, max_requests=1, max_batch=1) as alone_runner:
        alone = decode_alone_on(alone_runner, manifest, jobs)
    runner = TensorRTRunner.from_dir(engines, max_requests=max_requests, max_batch=max_batch)
    packed = count_packed(runner, "_run_packed")
    with runner:
        results = serve_together(runner, manifest, jobs, victim=jobs[0][0])
    assert [r.token_ids for r in results] == alone
    assert {r.finish_reason for r in results} == {"eos", "length"}
    assert packed and 2 <= max(packed) <= max_batch  # batches really ran, no wider than allowed
    assert cudart.allocations == {}


# -- the onnxruntime CUDA runner -------------------------------------------------------------------
def test_requests_served_together_get_their_tokens_alone_on_ort_cuda(tiny_export, jobs, fakes):
    _, cudart = fakes
    manifest = ExportManifest.load(tiny_export)
    with CpuBoundCudaRunner(manifest, threads=1) as alone_runner:
        alone = decode_alone_on(alone_runner, manifest, jobs)
    runner = CpuBoundCudaRunner(manifest, threads=1, max_requests=4, max_batch=4)
    packed = count_packed(runner, "_run_packed")
    with runner:
        results = serve_together(runner, manifest, jobs, victim=jobs[1][0])
    assert [r.token_ids for r in results] == alone
    assert packed and 2 <= max(packed) <= 4
    assert cudart.allocations == {}


def test_ort_cuda_packed_rows_write_each_region(tiny_export, fakes):
    """The batched binding on the fakes: rows' presents land in their own slots at write_at, the
    gathers and scatters run on the runner's stream (one synchronize before the run, one after)."""
    _, cudart = fakes
    manifest = ExportManifest.load(tiny_export)
    rng = np.random.default_rng(1)
    with CpuBoundCudaRunner(manifest, threads=1, max_requests=2, max_batch=2) as runner:
        rows = []
        for region, (past, seq) in enumerate([(5, 4), (9, 2)]):
            runner.allocate_kv(32, region)
            runner.run("infiller", rng.integers(0, 100, (1, past)), np.arange(past)[None],
                       masks.causal_after(0, past), 0, 0, region)
            rows.append(RowFeed(rng.integers(0, 100, (1, seq)), np.arange(past, past + seq)[None],
                                masks.causal_after(past, seq), past, past, region))
        alone = [runner.run_batch("infiller", [r])[0] for r in rows]
        kv_alone = [runner._kv.to_host(s, 0, 32) for s in range(2)]
        runner.run_batch("infiller", rows)  # allocates (and zeroes) the scratch; the second run reuses it
        syncs = cudart.syncs
        packed = runner.run_batch("infiller", rows)  # the same presents, written at the same places
        assert cudart.syncs - syncs == 2
        for a, b in zip(alone, packed):
            for name in a:  # log-probabilities of ~-17 differ in their last float32 bits between batch orders
                np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-5)
        for s in range(2):
            for name, got in runner._kv.to_host(s, 0, 32).items():
                np.testing.assert_allclose(got, kv_alone[s][name], rtol=0, atol=1e-5)
    assert cudart.allocations == {}


def test_cpu_bound_cuda_runner_is_the_real_class():
    """The test double overrides only where memory lives, so these tests run OrtCudaRunner's code."""
    overridden = {k for k, v in vars(CpuBoundCudaRunner).items() if not k.startswith("_")}
    assert overridden == {"provider", "device"}


def test_ordered_copies_and_zero(fakes):
    """copy_to(stream=) orders a stream-less buffer's copy on the caller's stream without waiting (a
    gather's many copies cost the caller's one synchronize); zero() clears what cudaMalloc left."""
    from refusion.runtime.runners import cuda

    _, cudart = fakes
    stream = cuda.Stream()
    src, dst = cuda.DeviceBuffer(64), cuda.DeviceBuffer(64, stream)
    dst.zero()
    np.testing.assert_array_equal(dst.copy_to_host((64,), np.uint8), np.zeros(64, np.uint8))
    src.copy_from_host(np.arange(64, dtype=np.uint8))
    syncs = cudart.syncs
    for start in (0, 16, 32):
        src.copy_to(dst, 16, src_offset=start, dst_offset=start + 16, stream=stream)
    assert cudart.syncs == syncs  # queued, not waited for
    stream.synchronize()
    np.testing.assert_array_equal(dst.copy_to_host((64,), np.uint8)[16:], np.arange(48, dtype=np.uint8))
    src.free(), dst.free(), stream.close()
    assert cudart.allocations == {}
