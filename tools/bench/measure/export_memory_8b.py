"""One decoder layer at ReFusion-8B's real shapes, exported per precision: export time, peak RSS of the
whole `refusion-export onnx` process (validation included) and weights.bin size. Writes
results/quantization/layer8b.json (merged by --label, so a before/after pair sits side by side); docs/quantization.md
quotes it.

    python -m refusion.tools.bench.measure.export_memory_8b --work /tmp/layer8b --label after [--precisions fp16 int4-rtn]

The checkpoint (tools/checks/fixtures/checkpoints.py, stored bf16 as ReFusion-8B's is: 2.87 GB, the embedding and
lm_head 2.48 GB of it) is made once in WORK and deleted at the end unless --keep. Each export runs as its own
process; its peak RSS is the kernel's (wait4's ru_maxrss), and a sampler reads its VmRSS every 50 ms and
charges each sample to the last progress line printed, so the peak can be placed in a stage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

SPEC = TinySpec(num_layers=1, hidden_size=4096, num_heads=32, kv_heads=8, head_dim=128, intermediate_size=12288,
                vocab_size=151671, dtype="bfloat16")
PRECISIONS = {  # name -> refusion-export onnx flags; int4 at fp16 scales, block 128, as for TensorRT
    "fp16": ["--dtype", "fp16"],
    "int4-rtn": ["--dtype", "fp16", "--quantize", "int4-rtn", "--block-size", "128"],
    "int4-awq": ["--dtype", "fp16", "--quantize", "int4-awq", "--block-size", "128"],
    "fp32": ["--dtype", "fp32"],
}
MIB = 2**20
OUT = Path("results/quantization/layer8b.json")  # from the checkout's root


def status_mib(pid: int) -> dict[str, float]:
    """VmRSS, RssAnon and RssFile of `pid` in MiB (empty once it has exited)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    fields = (line.partition(":") for line in text.splitlines())
    return {k: int(v.split()[0]) / 1024 for k, _, v in fields if k in ("VmRSS", "RssAnon", "RssFile")}


class Sampler(threading.Thread):
    """Largest VmRSS seen per stage (the last progress line before the sample), with its anon/file split."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.stage, self.peaks, self.done = pid, "start", {}, False

    def run(self) -> None:
        while not self.done:
            s = status_mib(self.pid)
            if s and s["VmRSS"] > self.peaks.get(self.stage, {}).get("VmRSS", 0):
                self.peaks[self.stage] = {k: round(v, 1) for k, v in s.items()}
            time.sleep(0.05)


def stage_of(line: str) -> str:
    """A progress line, without its varying numbers beyond the first words (so stages group)."""
    return " ".join(line.split()[:3])


def export(ckpt: Path, out: Path, flags: list[str]) -> dict:
    cmd = [str(Path(sys.executable).parent / "refusion-export"), "onnx", str(ckpt), "-o", str(out), "--force", *flags]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    log = []
    for line in proc.stderr:  # one line per progress event (not a terminal: no bars)
        log.append(line.rstrip())
        sampler.stage = stage_of(line)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    sampler.done = True
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + "\n".join(log[-20:]))
    return {"command": " ".join(["refusion-export", *cmd[1:]]), "wall_s": round(wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
            "weights_bytes": (out / "weights.bin").stat().st_size, "stage_peaks_mib": sampler.peaks,
            "loadavg_after": round(os.getloadavg()[0], 2), "log_tail": log[-6:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--label", default="measured")
    ap.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=["fp16", "int4-rtn", "int4-awq"])
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint in WORK for another run")
    args = ap.parse_args()
    ckpt = args.work / "checkpoint"
    if not (ckpt / "config.json").is_file():
        t0 = time.perf_counter()
        make_checkpoint(ckpt, SPEC)
        print(f"checkpoint made in {time.perf_counter() - t0:.0f} s", flush=True)
    ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    report = json.loads(OUT.read_text()) if OUT.is_file() else {}
    report["checkpoint"] = {"spec": SPEC.__dict__, "safetensors_bytes": ckpt_bytes}
    runs = report.setdefault("runs", {}).setdefault(args.label, {})
    for name in args.precisions:
        out = args.work / name
        row = export(ckpt, out, PRECISIONS[name])
        row["peak_over_checkpoint"] = round(row["peak_rss_mib"] * MIB / ckpt_bytes, 2)
        row["peak_over_weights_bin"] = round(row["peak_rss_mib"] * MIB / row["weights_bytes"], 2)
        runs[name] = row
        print(f"{args.label} {name}: {row['wall_s']} s, peak {row['peak_rss_mib']} MiB "
              f"({row['peak_over_checkpoint']} x checkpoint), weights.bin {row['weights_bytes']:,} B", flush=True)
        shutil.rmtree(out)
        OUT.write_text(json.dumps(report, indent=1) + "\n")
    if not args.keep:
        shutil.rmtree(ckpt)


if __name__ == "__main__":
    main()
