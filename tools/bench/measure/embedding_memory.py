"""Resident memory of the embedding table with `--embeddings host` against `graph`, on the onnxruntime CPU runner.

A random tiny model with ReFusion-8B's vocabulary (151,671 tokens; hidden 256, 2 layers) is exported both ways at
fp16. Each export is run in a fresh process: AR and ReFusion generations over PROMPTS, then the process's
VmRSS and, for the host table, the resident size (Rss) of its mapping of embeddings.bin from /proc/self/smaps,
against the table's size and against the pages the looked-up rows lie on (the least a gather can touch); then the
same lookups through a plain np.memmap of the file after reading it (cached, as a copy leaves it).
Writes results/memory/embeddings.json; docs/runtime.md quotes it. Linux only (/proc/self/smaps).

    python -m refusion.tools.bench.measure.embedding_memory --work DIR
"""

from __future__ import annotations

import argparse
import json
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np

VOCAB, HIDDEN = 151_671, 256
PROMPTS = [list(range(5 + 7 * i, 25 + 7 * i)) for i in range(8)]  # 8 prompts of 20 ids
SETTINGS = [{"mode": "ar", "gen_length": 32}, {"mode": "refusion", "gen_length": 32, "slot_size": 4}]
OUT = Path("results/memory/embeddings.json")  # from the checkout's root


def mapped_rss(file: Path) -> tuple[int, int]:
    """(resident bytes, mapped bytes) of this process's mappings of `file`, from /proc/self/smaps."""
    target = str(file.resolve())
    rss = size = 0
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == target
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
        elif inside and fields[0] == "Size:":
            size += int(fields[1]) * 1024
    return rss, size


def row_pages(ids: set[int], row_bytes: int) -> int:
    """Bytes of the distinct pages that the rows of `ids` lie on: what gathering them must make resident."""
    pages = {p for i in ids for p in range(i * row_bytes // mmap.PAGESIZE, ((i + 1) * row_bytes - 1) // mmap.PAGESIZE + 1)}
    return len(pages) * mmap.PAGESIZE


def vm_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def child(export: str) -> dict:
    from refusion.runtime.core.embeddings import TABLE_FILE
    from refusion.runtime.generator import Generator

    fed: set[int] = set()
    with Generator.from_dir(export, backend="ort-cpu", threads=1) as gen:
        for settings in SETTINGS:
            for prompt in PROMPTS:
                result = gen.generate(prompt_ids=prompt, **settings)
                fed |= set(prompt) | set(result.token_ids)
        out: dict = {"vm_rss_mib": round(vm_rss() / 2**20, 1), "distinct_ids": len(fed)}
        table = gen.runner.embeddings
        if table is not None:
            rows = table.rows
            rss, size = mapped_rss(Path(export) / TABLE_FILE)
            least = row_pages(fed, rows.shape[1] * rows.itemsize)
            out |= {"table_bytes": int(rows.nbytes), "mapped_bytes": size, "table_rss_bytes": rss,
                    "table_rss_fraction": round(rss / rows.nbytes, 5), "row_pages_bytes": least,
                    "rss_over_row_pages": round(rss / least, 2)}
            # The same lookups through a plain read-only map of the file once cached (as any read or copy of it
            # leaves it): what the table costs without EmbeddingTable's dropping of the cached pages here.
            file = Path(export) / TABLE_FILE
            file.read_bytes()
            plain = np.memmap(file, rows.dtype, "r", shape=rows.shape)
            np.take(plain, sorted(fed), axis=0)
            out["plain_map_rss_fraction"] = round((mapped_rss(file)[0] - rss) / rows.nbytes, 5)
    return out


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(child(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="where the checkpoint and the exports go")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    from refusion.export.exporter import export_onnx
    from refusion.tools.checks.fixtures.checkpoints import TinySpec, make_checkpoint

    ckpt = args.work / "ckpt"
    if not (ckpt / "config.json").is_file():
        make_checkpoint(ckpt, TinySpec(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=512))
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    results: dict = {"cpu": cpu, "model": {"vocab_size": VOCAB, "hidden_size": HIDDEN, "layers": 2, "dtype": "float16"},
                     "prompts": len(PROMPTS), "settings": SETTINGS}
    for placement in ("graph", "host"):
        out = args.work / placement
        if not (out / "refusion.json").is_file():
            export_onnx(ckpt, out, dtype="fp16", embeddings=placement, validate=False, force=True)
        run = subprocess.run([sys.executable, "-m", __spec__.name, "--child", str(out)], capture_output=True,
                             text=True, check=True)
        results[placement] = json.loads(run.stdout.strip().splitlines()[-1])
        print(placement, results[placement])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
