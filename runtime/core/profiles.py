"""Decode limits -> TensorRT optimization profiles, in one place.

Every forward the decode loop issues is a (graph, seq, past) point; `forward_boxes` lists,
for one request, the box of points each kind of forward can reach (the loop's shapes:
docs/decoding.md and runtime/decode/). The engines' profiles are derived from the
same boxes evaluated at the build limits, so a request whose boxes fit the limits is served
by construction, and `check_request` refuses one that does not before any GPU work, naming
the limit and the `refusion-export build` flag that raises it.

One engine, built from the infiller graph, serves both roles, so the weights are resident
once. Each profile serves one role (its `graph`): the infiller's forwards get two, because
their shapes are bimodal: prefill (prompt + first block, no past) and decode (at most one
block over a long past); one profile spanning both would tune kernels for neither. The
planner's forwards get their own decode profile ("plan"), tuned for a whole block of masks.

Batch (`max_batch`, `--max-batch`): the decode and plan profiles take 1..max_batch rows, one
per request, so the engine thread packs the requests' short forwards into one execution;
those forwards read the weights once for every row, which is where batching pays. The prefill
profile stays at batch 1: a prefill is already hundreds of tokens (compute-bound, little to
gain from packing) and its activations are the engine's largest, which a batch would multiply.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from refusion.runtime.core.contract import (
    BATCH,
    GRAPH_NAMES,
    HEADS,
    MASK_HEADS,
    PAST_SEQ,
    SEQ,
    TOTAL_SEQ,
    GraphName,
    GraphSpec,
)
from refusion.runtime.core.defaults import DecodeDefaults
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.settings import DEFAULTS

Range = tuple[int, int, int]  # min, opt, max
# The most tokens one forward feeds unless told otherwise, at build time and at run time: a longer prefill runs in
# chunks (docs/runtime.md, "Chunked prefill", says why this many: the measured cost on the CPU, and the prefill
# activations an engine must hold, which decide whether ReFusion-8B int4 fits an Orin Nano 8GB).
DEFAULT_PREFILL_CHUNK = 256
ShapeRange = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class DecodeLimits:
    """What the engines are built for: the defaults are the paper's gsm8k setting, which also
    covers every other row of its settings table (their blocks are no longer)."""

    max_prompt: int = 2048
    gen_length: int = DEFAULTS["gen_length"]  # padded up to whole slots, as the loop pads it
    slot_size: int = DEFAULTS["slot_size"]
    serial_blocks: int = DEFAULTS["serial_num_blocks"]  # engines.json's name for it
    max_slots: int | None = None  # slots per block the engines take; None: gen_length / serial_blocks / slot_size
    max_batch: int = 1  # rows (requests) one decode forward packs; 1: the batch-1 engines of format v2
    # tokens one forward feeds at most: a longer prefill runs as chunks of it (runtime/decode/chunks.py), so the
    # prefill profile spans 1..prefill_chunk tokens over a past, not the whole prompt; None: no bound
    prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_prompt", "gen_length", "slot_size", "serial_blocks", "max_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise RefusionError(f"--{_flag(name)} {value!r} must be a positive integer.")
        padded = self.gen_length + (-self.gen_length % self.slot_size)
        object.__setattr__(self, "gen_length", padded)
        if padded % self.serial_blocks or (padded // self.serial_blocks) % self.slot_size:
            raise RefusionError(
                f"--gen-length {padded} cannot be cut into --serial-num-blocks {self.serial_blocks} blocks of whole "
                f"--slot-size {self.slot_size} slots; choose gen_length as a multiple of "
                f"slot_size x serial_blocks = {self.slot_size * self.serial_blocks}."
            )
        per_block = padded // self.serial_blocks // self.slot_size
        slots = per_block if self.max_slots is None else self.max_slots
        if not isinstance(slots, int) or isinstance(slots, bool) or not per_block <= slots <= padded // self.slot_size:
            raise RefusionError(
                f"--max-slots {slots!r} must lie in [{per_block}, {padded // self.slot_size}]: at least the "
                f"{per_block} slots of one block (gen_length / serial_blocks / slot_size), and a block is at "
                "most the whole generation."
            )
        object.__setattr__(self, "max_slots", slots)
        chunk = self.prefill_chunk
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < self.block_length):
            raise RefusionError(
                f"--prefill-chunk {chunk!r} must be an integer of at least the engines' block of {self.block_length} "
                f"tokens (--max-slots {slots} x --slot-size {self.slot_size}): a plan or a verify forward feeds a "
                "block and cannot be cut; raise it, build for smaller blocks, or pass --prefill-chunk 0 for no bound.")

    @property
    def block_length(self) -> int:
        """The longest block the engines take: max_slots x slot_size tokens."""
        assert self.max_slots is not None  # resolved in __post_init__
        return self.max_slots * self.slot_size

    @property
    def kv_capacity(self) -> int:
        """KV tokens the loop allocates at the limits: prompt, generation, one block of scratch."""
        return self.max_prompt + self.gen_length + self.block_length

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> DecodeLimits:
        return DecodeLimits(**d)

    def flags(self) -> list[str]:
        """These limits as `refusion-export build` flags (no bound is `--prefill-chunk 0`: left out, the build
        takes its default bound)."""
        return [f"--max-prompt {self.max_prompt}", f"--gen-length {self.gen_length}", f"--slot-size {self.slot_size}",
                f"--serial-num-blocks {self.serial_blocks}", f"--max-slots {self.max_slots}",
                f"--max-batch {self.max_batch}", f"--prefill-chunk {self.prefill_chunk or 0}"]

    def with_prefill_chunk(self, asked: int | None) -> DecodeLimits:
        """These limits with the prefill bound `refusion-export build` takes for `--prefill-chunk asked`: that many
        tokens, 0 for none, None (left out) for DEFAULT_PREFILL_CHUNK, or the block where that is longer (a plan or
        verify forward feeds a whole block), so a default build is never refused for its bound."""
        chunk = max(DEFAULT_PREFILL_CHUNK, self.block_length) if asked is None else asked or None
        return replace(self, prefill_chunk=chunk)


def export_limits(defaults: DecodeDefaults, max_positions: int, *, max_prompt: int | None = None,
                  gen_length: int | None = None, slot_size: int | None = None, serial_blocks: int | None = None,
                  max_slots: int | None = None, max_batch: int = 1, prefill_chunk: int | None = None) -> DecodeLimits:
    """What `refusion-export build` builds for by default: the decode settings the export recorded
    (refusion.json `defaults`: gen_length, slot_size, serial_num_blocks), the longest prompt that fits
    beside that generation in the model's positions, at most DecodeLimits' 2048, and the default prefill bound
    (`DecodeLimits.with_prefill_chunk`; 0: none). Each value given overrides."""
    gen_length = defaults.gen_length if gen_length is None else gen_length
    if max_prompt is None:
        max_prompt = min(DecodeLimits.max_prompt, max_positions - gen_length)
    limits = DecodeLimits(max_prompt, gen_length, defaults.slot_size if slot_size is None else slot_size,
                          defaults.serial_num_blocks if serial_blocks is None else serial_blocks, max_slots, max_batch)
    return limits.with_prefill_chunk(prefill_chunk)


@dataclass(frozen=True)
class Box:
    """The (seq, past) points one kind of forward can reach, inclusive."""

    graph: GraphName
    kind: str
    seq: tuple[int, int]
    past: tuple[int, int]


def forward_boxes(prompt_len: int, gen_length: int, block_length: int, prefill_chunk: int | None = None) -> list[Box]:
    """Every forward of a request (prompt P0, padded gen_length G, block length b), by kind.

    Plan and verify run over the committed prefix, P0 <= past <= P0 + G. Infill rows see the
    prefix plus n <= b/k private rows of scratch, so their past reaches P0 + G + b. The AR
    baseline prefills the prompt, then feeds one token at a time. With `prefill_chunk` C, a prefill
    longer than C runs as chunks of at most C tokens, each over the KV of the ones before it.
    """
    p, g, b = prompt_len, gen_length, block_length
    prefill, ar_prefill = _prefill_box(p + b, prefill_chunk), _prefill_box(p, prefill_chunk)
    return [
        Box("infiller", "prefill_plan", *prefill),
        Box("planner", "plan", (1, b), (p, p + g)),
        Box("infiller", "verify", (1, b), (p, p + g)),
        Box("planner", "infill_draft", (1, b), (p, p + g + b)),
        Box("infiller", "infill_verify", (1, b), (p, p + g + b)),
        Box("infiller", "ar_prefill", *ar_prefill),
        Box("infiller", "ar_decode", (1, 1), (p, p + g)),
    ]


def _prefill_box(tokens: int, chunk: int | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(seq, past) of a prefill of `tokens`: one forward, or chunks of at most `chunk` over what came before."""
    if chunk is None or tokens <= chunk:
        return (tokens, tokens), (0, 0)
    return (1, chunk), (0, tokens - 1)


@dataclass(frozen=True)
class ProfileSpec:
    """One optimization profile of the engine: ranges of the three free dims (every input shape
    follows), and the role whose forwards it serves."""

    name: str
    graph: GraphName  # planner forwards run on the planner's profiles, infiller forwards on the infiller's
    seq: Range
    past: Range
    batch: Range = (1, 1, 1)  # rows; format v2 engines were all batch 1
    heads: Range | None = None  # head positions a forward computes; None: 1 up to seq (engines built before them)

    @property
    def head_range(self) -> Range:
        """The head positions' range: at most a block, whatever the seq (a prefill reads only its masks'), so
        TensorRT sizes the vocabulary head's activations for a block, not for the prompt."""
        return self.heads if self.heads is not None else (1, self.seq[1], self.seq[2])

    def contains(self, seq: int, past: int, batch: int = 1, heads: int = 1) -> bool:
        h = self.head_range
        return (self.seq[0] <= seq <= self.seq[2] and self.past[0] <= past <= self.past[2]
                and self.batch[0] <= batch <= self.batch[2] and h[0] <= heads <= h[2])

    def shapes(self, spec: GraphSpec) -> dict[str, ShapeRange]:
        """min/opt/max shape of each input of `spec`, from its symbolic axes."""
        out = {}
        for tensor in spec.inputs:
            dims = [self._dims(axis) for axis in tensor.axes]
            lo, opt, hi = (tuple(d[i] for d in dims) for i in range(3))
            out[tensor.name] = (lo, opt, hi)
        return out

    def _dims(self, axis: str | int) -> Range:
        if isinstance(axis, int):
            return axis, axis, axis
        s, p = self.seq, self.past
        h = self.head_range
        ranges: dict[str, Range] = {BATCH: self.batch, SEQ: s, PAST_SEQ: p, HEADS: h,
                                    TOTAL_SEQ: (s[0] + p[0], s[1] + p[1], s[2] + p[2]),
                                    MASK_HEADS: (1, 1, h[2])}  # one row for every head (no guide), or one a head
        if axis not in ranges:
            raise RefusionError(f"graph axis {axis!r} has no profile rule; the export is newer than this builder.")
        return ranges[axis]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "graph": self.graph, "seq": list(self.seq), "past": list(self.past),
                "batch": list(self.batch), "heads": list(self.head_range)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> ProfileSpec:
        """A profile as engines.json records it; one without "batch" (format v2) is batch 1."""
        seq, past = (tuple(int(x) for x in d[key]) for key in ("seq", "past"))
        batch = tuple(int(x) for x in d.get("batch", (1, 1, 1)))
        heads = tuple(int(x) for x in d["heads"]) if "heads" in d else None
        if len(seq) != 3 or len(past) != 3 or len(batch) != 3 or (heads is not None and len(heads) != 3):
            raise ValueError(f"profile {d.get('name')!r}: seq, past, batch and heads need min, opt, max")
        if not 1 <= batch[0] <= batch[1] <= batch[2]:
            raise ValueError(f"profile {d.get('name')!r}: batch {list(batch)} is not 1 <= min <= opt <= max")
        if d["graph"] not in GRAPH_NAMES:
            raise ValueError(f"profile {d.get('name')!r}: graph {d['graph']!r} is not one of {GRAPH_NAMES}")
        return ProfileSpec(d["name"], d["graph"], (seq[0], seq[1], seq[2]), (past[0], past[1], past[2]),
                           (batch[0], batch[1], batch[2]), None if heads is None else (heads[0], heads[1], heads[2]))


def engine_profiles(limits: DecodeLimits) -> list[ProfileSpec]:
    """The profiles of the one engine, in TensorRT's order. Opt is the typical decode shape: a
    mid-length request halfway through its generation; the planner's typical call plans a whole
    block, the infiller's verifies one slot; half the batch (requests in flight, half loaded).
    Prefill stays at batch 1 (module docstring). Every profile computes at most a block of heads: what a
    forward reads (the prefill's masks, a verified block, AR's one token)."""
    p, g, b, k = limits.max_prompt, limits.gen_length, limits.block_length, limits.slot_size
    past_max = p + g + b  # infill scratch after a full prefix: the largest past of any box
    past_opt = p // 2 + g // 2
    n = limits.max_batch
    rows = (1, (n + 1) // 2, n)
    # a prefill whole (over no past), or, with a bound, a chunk of it over the chunks before it (or a cached prefix);
    # a chunk is never longer than the longest prefill, however large the bound
    c = None if limits.prefill_chunk is None else min(limits.prefill_chunk, p + b)
    prefill = ((1, p // 2 + b, p + b), (0, 0, 0)) if c is None else ((1, min(c, p // 2 + b), c), (0, p // 2, p + b - 1))
    return [
        ProfileSpec("prefill", "infiller", *prefill, heads=(1, b, b)),
        ProfileSpec("decode", "infiller", (1, min(k, b), b), (0, past_opt, past_max), rows, (1, min(k, b), b)),
        ProfileSpec("plan", "planner", (1, b, b), (0, past_opt, past_max), rows, (1, b, b)),
    ]


def select_profile(profiles: list[ProfileSpec], graph: GraphName, seq: int, past: int, batch: int = 1,
                   heads: int = 1) -> int | None:
    """Index of the first profile serving `graph` that holds (seq, past, batch, heads); most specific first."""
    return next((i for i, prof in enumerate(profiles)
                 if prof.graph == graph and prof.contains(seq, past, batch, heads)), None)


def box_profile(profiles: list[ProfileSpec], box: Box) -> int | None:
    """Index of the first profile serving the box's graph that holds the whole box (all four corners)."""
    corners = [(s, p) for s in box.seq for p in box.past]
    return next((i for i, prof in enumerate(profiles)
                 if prof.graph == box.graph and all(prof.contains(s, p) for s, p in corners)), None)


def check_request(limits: DecodeLimits, prompt_len: int, gen_length: int, slot_size: int, serial_blocks: int) -> None:
    """Refuse a request the engines cannot serve, naming the limit and the flag to rebuild with."""
    gen = gen_length + (-gen_length % slot_size)
    block = gen // serial_blocks
    rebuild = "rebuild the engines with `refusion-export build EXPORT_DIR --output ENGINES_DIR"
    if prompt_len > limits.max_prompt:
        raise RefusionError(
            f"the prompt has {prompt_len} tokens; the engines take at most --max-prompt {limits.max_prompt}. "
            f"Shorten the prompt or {rebuild} --max-prompt {_round_up(prompt_len)}`."
        )
    if gen > limits.gen_length:
        raise RefusionError(
            f"gen_length {gen} (padded to slot_size {slot_size}) exceeds the engines' --gen-length "
            f"{limits.gen_length}; lower gen_length or {rebuild} --gen-length {gen}`.", "gen_length"
        )
    if block > limits.block_length:
        fewest = math.ceil(gen / limits.block_length)
        raise RefusionError(
            f"a block of {block} tokens (gen_length {gen} / serial_num_blocks {serial_blocks}) exceeds the engines' "
            f"block of {limits.block_length} tokens (--max-slots {limits.max_slots} x --slot-size {limits.slot_size}); "
            f"use serial_num_blocks >= {fewest}, or {rebuild} --max-slots {math.ceil(block / limits.slot_size)}`."
        )
    # Fitting the three limits above puts every box inside a profile; keep that true by construction.
    profiles = engine_profiles(limits)
    for box in forward_boxes(prompt_len, gen, block, limits.prefill_chunk):
        assert box_profile(profiles, box) is not None, box


def _round_up(n: int) -> int:
    """A rebuild suggestion with headroom: the next power of two."""
    return 1 << (n - 1).bit_length()


def _flag(field: str) -> str:
    return field.replace("_", "-")
