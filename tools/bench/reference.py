"""Independent PyTorch reference of ReFusion's default decoding loop (the test oracle).

The spec is ``generate_refusion`` in upstream ML-GSAI/ReFusion ``generate.py``
(summarised in docs/decoding.md; where they disagree the code wins).
This file re-implements the same semantics, written from scratch for
readability, on a stock Hugging Face ``transformers`` ``Qwen3ForCausalLM``.
The runtime must produce exactly the token ids this produces, so upstream
quirks are reproduced on purpose; each one is marked "UPSTREAM QUIRK".

Vocabulary used below
---------------------
* C: the committed sequence (prompt, then committed tokens *in commit order*),
  each token with its true position id, and the KV cache of C.
* R: the not yet generated slots of the current block, in position order; a
  slot is identified by its index into R (the "R index").
* chosen: the slots picked by the planner this iteration, sorted; "row r" is
  the r-th chosen slot.

KV cache handling
-----------------
Rather than mutating a ``DynamicCache`` in place (upstream relies on the model
appending to the cache it is given, then crops it back), every forward here is
functional: ``_forward`` builds a fresh ``DynamicCache`` from a ``_KV`` value,
runs the model, and returns a *new* ``_KV`` = past + inputs. The lifecycle is
the upstream one:

* the first plan forward is fused with the prompt prefill; its KV is cropped
  back to the prompt;
* later plan forwards and every infill *draft* forward discard their KV;
* a verification whose prefix is committed keeps its KV (the committed tokens
  are a prefix of the verified concatenation, so "crop to new |C|" is exact);
* the infill loop repeats C's KV once per row, keeps per row the KV of the
  accepted part after each verify pass, and finally appends to C, row after
  row, each row's KV *from its own last verify pass* (which saw C and that row
  only, not the sibling rows ahead of it in C). That last point means C's cache
  is then NOT what a causal forward over C would give; ``_KV`` therefore also
  records, per cached token, which earlier cached tokens it attended to
  (``_Row.vis``), so tests can rebuild every cached forward without a cache.

Only temperature 0 is implemented: Gumbel noise drawn here could never match the
noise of another implementation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from transformers import DynamicCache

FORWARD_KINDS = ("prefill_plan", "plan", "verify", "infill_draft", "infill_verify")
BRANCHES = (
    "commit_from_verification",  # verification committed >= 1 whole slot, no EOS in its prefix
    "infill_loop",  # the parallel infill loop ran
    "eos_in_verification",  # an EOS inside the verified prefix ended the block
    "eos_in_infill",  # an accepted EOS showed up inside the infill loop
    "fallback_single_slot",  # no slot above slot_threshold: the most confident one was taken
)


@dataclass
class ReferenceResult:
    # Generated ids sorted by position id, prompt excluded (upstream's x[:, prompt_len:]).
    # Shorter than gen_length after an EOS, and may have holes in position
    # space (see positions) because of the infill EOS quirk.
    token_ids: list[int]
    # Upstream's TPF: sum_TPF / forward_count, with upstream's own accounting.
    tpf: float
    # Model forward calls by kind: exactly the keys FORWARD_KINDS.
    forwards: Counter = field(default_factory=Counter)
    # How often each decoding branch ran: exactly the keys BRANCHES.
    branches: Counter = field(default_factory=Counter)
    # Position ids of token_ids (ascending).
    positions: list[int] = field(default_factory=list)
    # (position, token) of every generated token in commit order, i.e. the
    # order in which the tokens sit in the KV cache after the prompt.
    commit_order: list[tuple[int, int]] = field(default_factory=list)
    # Times the fallback picked among exactly equal top confidences
    # (torch.topk's tie-break is implementation defined; a run with ties > 0
    # can legitimately differ from another implementation).
    fallback_ties: int = 0
    # Slots the infill-EOS quirk dropped that the R-index rule would have kept
    # (never generated: holes in ``positions``). See "UPSTREAM QUIRK" below.
    quirk_dropped_slots: int = 0
    # Upstream's raw accumulators (tpf == sum_tpf / tpf_count).
    sum_tpf: float = 0.0
    tpf_count: int = 0

    @property
    def total_forwards(self) -> int:
        return sum(self.forwards.values())

    @property
    def tokens_per_forward(self) -> float:
        """Plain generated tokens / model forwards (not upstream's TPF)."""
        return len(self.token_ids) / self.total_forwards


# ---------------------------------------------------------------------------
# KV cache as a value
# ---------------------------------------------------------------------------


@dataclass
class _Row:
    """What one batch row of a cache holds: token ids, position ids, and for
    each cached token i the context its KV was computed with, as (p, s):
    token i attended to cached tokens [0, p) and [s, i]. A token computed by
    an ordinary causal forward has (p, s) = (i, i), i.e. it saw [0, i]."""

    ids: list[int]
    pos: list[int]
    vis: list[tuple[int, int]]

    def __len__(self) -> int:
        return len(self.ids)

    def crop(self, n: int) -> "_Row":
        return _Row(self.ids[:n], self.pos[:n], self.vis[:n])


@dataclass
class _KV:
    """Per-layer (key, value) tensors [batch, kv_heads, length, head_dim] plus
    the bookkeeping rows (one per batch row)."""

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    rows: list[_Row]

    @property
    def length(self) -> int:
        return len(self.rows[0])

    @property
    def batch(self) -> int:
        return len(self.rows)

    def crop(self, n: int) -> "_KV":
        """Keep the first n cached tokens (DynamicCache.crop)."""
        return _KV([(k[:, :, :n], v[:, :, :n]) for k, v in self.layers], [r.crop(n) for r in self.rows])

    def repeat(self, n: int) -> "_KV":
        """Batch 1 -> batch n copies (DynamicCache.batch_repeat_interleave)."""
        assert self.batch == 1
        return _KV(
            [(k.repeat_interleave(n, dim=0), v.repeat_interleave(n, dim=0)) for k, v in self.layers],
            [self.rows[0]] * n,
        )

    def first_rows(self, n: int) -> "_KV":
        """Keep batch rows [0, n)."""
        return _KV([(k[:n], v[:n]) for k, v in self.layers], self.rows[:n])


ForwardHook = Callable[["ForwardRecord"], None]


@dataclass
class ForwardRecord:
    """One model call, for tests that re-check the cache (see ``trace``)."""

    kind: str
    input_ids: torch.Tensor  # [batch, L]
    position_ids: torch.Tensor  # [batch, L]
    past: Optional[_KV]  # the cache the call ran over (None: no cache)
    logits: torch.Tensor  # [batch, L, vocab]


def _forward(model, kind, ids, pos, past, forwards, trace) -> tuple[torch.Tensor, _KV]:
    """Run the model on ``ids`` (with position ids ``pos``) after ``past``.

    Attention is causal in sequence order (cache first, then the inputs in
    order); the position ids only feed RoPE. Returns fp32 logits [B, L, V] and
    the cache extended by the inputs (the caller crops / drops it).
    """
    forwards[kind] += 1
    if past is None:
        cache = DynamicCache(config=model.config)
        past_rows = [_Row([], [], [])] * ids.shape[0]
    else:
        assert past.batch == ids.shape[0]
        cache = DynamicCache(ddp_cache_data=past.layers, config=model.config)
        past_rows = past.rows
    # Passing a cache (even an empty one) also keeps transformers from reading
    # non-consecutive position ids as "packed sequences" (it only does that
    # when no cache and no mask are given), which would break causality.
    out = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
    logits = out.logits.float()
    layers = [(layer.keys, layer.values) for layer in out.cache.layers]
    rows = []
    for b, row in enumerate(past_rows):
        m = len(row)
        new_ids = ids[b].tolist()
        rows.append(
            _Row(
                row.ids + new_ids,
                row.pos + pos[b].tolist(),
                row.vis + [(m + j, m + j) for j in range(len(new_ids))],
            )
        )
    new = _KV(layers, rows)
    if trace is not None:
        trace(ForwardRecord(kind, ids.clone(), pos.clone(), past, logits))
    return logits, new


def _ar_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Probability of each token under the autoregressive reading.

    Token j is scored by the logits at j-1 (the previous real token predicts
    it). Token 0 has no predecessor in the input; upstream scores it with its
    own logits (``cat([logits[:, :1], logits[:, :-1]])``). That value is never
    used: token 0 is always force-accepted by the callers.
    """
    shifted = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    probs = F.softmax(shifted, dim=-1)
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ---------------------------------------------------------------------------
# The decoding loop
# ---------------------------------------------------------------------------


@torch.no_grad()
def refusion_generate(
    model,
    prompt_ids: list[int],
    *,
    gen_length: int,
    slot_size: int,
    serial_num_blocks: int,
    slot_threshold: float,
    token_threshold: float,
    mask_id: int,
    eos_id: int,
    temperature: float = 0.0,
    trace: Optional[ForwardHook] = None,
) -> ReferenceResult:
    """ReFusion decoding of one prompt, token for token as upstream at temperature 0.

    ``trace``, if given, is called with a ``ForwardRecord`` after every model call.
    """
    if temperature != 0:
        raise NotImplementedError("only temperature 0 is reproducible (Gumbel noise can't be shared)")
    if not prompt_ids:
        raise ValueError("empty prompt")
    if slot_size < 1 or gen_length < 1 or serial_num_blocks < 1:
        raise ValueError("slot_size, gen_length and serial_num_blocks must be >= 1")
    k = slot_size
    device = model.device

    # gen_length is padded up to a whole number of slots; the blocks are then
    # gen_length // serial_num_blocks long.
    gen_length += (-gen_length) % k
    block_length = gen_length // serial_num_blocks
    if block_length == 0 or block_length % k:
        # Upstream fails here too (a reshape error, or a 0/0 TPF).
        raise ValueError(f"block length {block_length} is not a positive multiple of slot_size {k}")
    # NOTE: if gen_length is not a multiple of serial_num_blocks, upstream
    # silently never generates the last gen_length % serial_num_blocks
    # positions; so does this (blocks below cover serial_num_blocks * block_length).

    P = len(prompt_ids)
    res = ReferenceResult(token_ids=[], tpf=0.0)
    # Every key present (zero if it never happened).
    res.forwards.update(dict.fromkeys(FORWARD_KINDS, 0))
    res.branches.update(dict.fromkeys(BRANCHES, 0))
    forwards = res.forwards
    branches = res.branches

    def lt(x):  # list of ints -> [1, n] LongTensor
        return torch.tensor([x], dtype=torch.long, device=device)

    committed_ids = list(prompt_ids)  # C, in commit (= cache) order
    committed_pos = list(range(P))
    kv: Optional[_KV] = None  # KV of C (batch 1); None until the fused prefill ran
    stop_after_block = False

    for block in range(serial_num_blocks):
        block_start = P + block * block_length
        # R: start positions of this block's remaining slots, ascending.
        R = [block_start + i * k for i in range(block_length // k)]

        while R:
            n_ctx = len(committed_ids)

            # ---- 1. Plan: all masks of R, in position order, after C. ----
            mask_pos = [s + j for s in R for j in range(k)]
            if kv is None:
                # The very first plan is fused with the prompt prefill; only
                # the prompt part of its KV is kept.
                logits, full = _forward(
                    model,
                    "prefill_plan",
                    lt(committed_ids + [mask_id] * len(mask_pos)),
                    lt(committed_pos + mask_pos),
                    None,
                    forwards,
                    trace,
                )
                kv = full.crop(n_ctx)
                logits = logits[:, n_ctx:]
            else:
                logits, _ = _forward(
                    model, "plan", lt([mask_id] * len(mask_pos)), lt(mask_pos), kv, forwards, trace
                )
            # Mask reading: the logits at a mask predict the token at that position.
            probs = F.softmax(logits[0], dim=-1)  # [|R|*k, V]
            draft = logits[0].argmax(-1)  # first index on ties (documented torch.argmax)
            draft_p = probs.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
            draft = draft.view(len(R), k)
            slot_conf = draft_p.view(len(R), k)[:, 0]  # a slot's confidence = p of its first token

            chosen = [i for i in range(len(R)) if slot_conf[i] > slot_threshold]
            if not chosen:
                # Fallback: the single most confident slot. Upstream picks it
                # with torch.topk(k=1), whose tie-break is not "first index";
                # use the same call so CPU results agree, and count ties.
                branches["fallback_single_slot"] += 1
                best = int(torch.topk(slot_conf, k=1).indices[0])
                if int((slot_conf == slot_conf[best]).sum()) > 1:
                    res.fallback_ties += 1
                chosen = [best]
            chosen.sort()  # rows follow position order
            n = len(chosen)
            rows_tok = draft[chosen]  # [n, k]
            rows_pos = torch.tensor([[R[i] + j for j in range(k)] for i in chosen], device=device)

            # ---- 2. Global verification: the chosen drafts concatenated, after C. ----
            flat_tok = rows_tok.reshape(1, -1)
            vlogits, vkv = _forward(model, "verify", flat_tok, rows_pos.reshape(1, -1), kv, forwards, trace)
            ar_p = _ar_probs(vlogits, flat_tok).view(n, k)
            accepted = ar_p > token_threshold
            # The first token of every chosen slot counts as accepted (it was
            # chosen for its planner confidence; its AR score is never looked at).
            accepted[:, 0] = True
            # Per-row accepted prefixes (used by the infill loop) ...
            tags = torch.cumprod(accepted.int(), dim=1).bool()
            # ... and L, the accepted prefix of the whole concatenation.
            L = int(torch.cumprod(accepted.reshape(-1).int(), dim=0).sum())
            prefix = flat_tok[0, :L].tolist()

            if eos_id in prefix:
                # EOS inside the verified prefix: commit everything up to and
                # including the first EOS (whole chosen slots, then the EOS
                # slot cut right after the EOS), with the KV of this pass.
                branches["eos_in_verification"] += 1
                e = prefix.index(eos_id)
                v_eos_row = e // k  # the chosen row (slot) holding it
                new_ids = prefix[: e + 1]
                new_pos = rows_pos.reshape(-1)[: e + 1].tolist()
                committed_ids += new_ids
                committed_pos += new_pos
                res.commit_order += list(zip(new_pos, new_ids))
                kv = vkv.crop(len(committed_ids))
                # Drop the committed slots and every slot of R from the EOS
                # slot on; unchosen slots before it stay and get generated
                # before the block ends.
                eos_r_index = chosen[v_eos_row]
                gone = set(chosen[: v_eos_row + 1]) | set(range(eos_r_index, len(R)))
                R = [s for i, s in enumerate(R) if i not in gone]
                stop_after_block = True
                # Upstream TPF: (whole) committed slots over 2 forwards.
                res.sum_tpf += k * (v_eos_row + 1) / 2
                res.tpf_count += 1
                continue

            if L >= k:
                # Commit the first floor(L/k) chosen slots whole, with the KV of
                # this pass (exact: the concatenation is causal and the
                # committed tokens are its prefix). The other chosen slots go
                # back to R and are re-planned.
                branches["commit_from_verification"] += 1
                m = L // k
                new_ids = flat_tok[0, : m * k].tolist()
                new_pos = rows_pos[:m].reshape(-1).tolist()
                committed_ids += new_ids
                committed_pos += new_pos
                res.commit_order += list(zip(new_pos, new_ids))
                kv = vkv.crop(len(committed_ids))
                gone = set(chosen[:m])
                R = [s for i, s in enumerate(R) if i not in gone]
                res.sum_tpf += k * m / 2
                res.tpf_count += 1
                continue

            # ---- 3. Parallel infill: L < k, nothing committed; the
            # verification KV is dropped (the cache goes back to C). ----
            branches["infill_loop"] += 1
            removed = set(chosen)  # all chosen slots leave R, even rows cut by an EOS below
            rows_tok = rows_tok.clone()
            row_kv = kv.repeat(n)  # every row starts from C's KV
            a = 0  # common window start: tokens [0, a) of every row are accepted and cached
            eos_row: Optional[int] = None  # first row holding an accepted EOS (upstream: first_eos_block_idx)
            passes = 0
            broke = False
            for _ in range(k):
                if bool(tags.all()):
                    broke = True
                    break
                passes += 1
                win_tok = rows_tok[:, a:]
                win_pos = rows_pos[:, a:]
                win_tags = tags[:, a:]

                # Draft: unaccepted tokens become masks; the mask reading's
                # argmax replaces them. KV discarded.
                dlogits, _ = _forward(
                    model,
                    "infill_draft",
                    torch.where(win_tags, win_tok, torch.full_like(win_tok, mask_id)),
                    win_pos,
                    row_kv,
                    forwards,
                    trace,
                )
                win_tok = torch.where(win_tags, win_tok, dlogits.argmax(-1))
                rows_tok[:, a:] = win_tok

                # Verify the updated window (AR reading), keeping its KV.
                vlogits, vkv = _forward(model, "infill_verify", win_tok, win_pos, row_kv, forwards, trace)
                ok = _ar_probs(vlogits, win_tok) > token_threshold
                # "Keep at least one token": a token is accepted if the token
                # before it was accepted before this pass (so every pass
                # extends each row by >= 1). The window's first token is
                # always accepted (its predecessor is, or it starts the slot).
                prev_tag = torch.cat([torch.ones_like(win_tags[:, :1]), win_tags[:, :-1]], dim=1)
                ok |= prev_tag
                tags[:, a:] = torch.cumprod(ok.int(), dim=1).bool()

                eos_hits = (rows_tok[:, a:] == eos_id) & tags[:, a:]
                if bool(eos_hits.any()):
                    # Rows after the first row with an accepted EOS are
                    # dropped; that row counts as fully accepted (its tail
                    # after the EOS is cut at commit time).
                    eos_row = int(eos_hits.any(dim=1).nonzero()[0, 0])
                    rows_tok = rows_tok[: eos_row + 1]
                    rows_pos = rows_pos[: eos_row + 1]
                    tags = tags[: eos_row + 1]
                    tags[eos_row] = True
                    chosen = chosen[: eos_row + 1]
                    vkv = vkv.first_rows(eos_row + 1)

                # Advance the window by the least number of accepted tokens in
                # it across rows, minus one while anything is unaccepted (the
                # last commonly accepted token is fed again next pass, so the
                # next window starts with an accepted token).
                adv = int(tags[:, a:].sum(dim=1).min())
                assert adv >= 1  # the window's first token is always accepted
                a += adv - 1 if not bool(tags.all()) else adv
                row_kv = vkv.crop(n_ctx + a)

            # Upstream TPF: k*n tokens (n = rows before any EOS cut) over the
            # forwards of this iteration. Upstream divides by
            # 2*loop_iter + 2 with loop_iter the for-loop variable after the
            # loop: the pass count when the loop broke, k-1 when it ran out
            # (unreachable: every pass accepts >= 1 more token per row, so all
            # is accepted after k-1 passes).
            loop_iter = passes if broke else k - 1
            res.sum_tpf += k * n / (loop_iter * 2 + 2)
            res.tpf_count += 1

            # All tokens are now accepted and a == k: row r's cache is C plus
            # its own k tokens, from its last verify pass.
            assert a == k and row_kv.length == n_ctx + k

            # Commit the rows in row order, up to and including the first EOS
            # across all rows, each token with its own row's KV. Its recorded
            # context: C (the first n_ctx tokens) and its own row.
            flat = rows_tok.reshape(-1).tolist()
            flat_pos = rows_pos.reshape(-1).tolist()
            keep = flat.index(eos_id) + 1 if eos_id in flat else len(flat)
            new_layers: list[tuple[torch.Tensor, torch.Tensor]] = []
            for key, val in row_kv.layers:
                # [rows, H, k, D] -> [1, H, rows*k, D], row-major, then keep a prefix.
                tail_k = key[:, :, n_ctx:].permute(1, 0, 2, 3).reshape(1, key.shape[1], -1, key.shape[3])
                tail_v = val[:, :, n_ctx:].permute(1, 0, 2, 3).reshape(1, val.shape[1], -1, val.shape[3])
                k0, v0 = kv.layers[len(new_layers)]
                new_layers.append(
                    (torch.cat([k0, tail_k[:, :, :keep]], dim=2), torch.cat([v0, tail_v[:, :, :keep]], dim=2))
                )
            base = kv.rows[0]
            vis = base.vis + [(n_ctx, n_ctx + (j // k) * k) for j in range(keep)]
            kv = _KV(new_layers, [_Row(base.ids + flat[:keep], base.pos + flat_pos[:keep], vis)])
            committed_ids += flat[:keep]
            committed_pos += flat_pos[:keep]
            res.commit_order += list(zip(flat_pos[:keep], flat[:keep]))

            if eos_row is not None:
                branches["eos_in_infill"] += 1
                stop_after_block = True
                # UPSTREAM QUIRK: upstream removes R indices
                # range(first_eos_block_idx, len(R)), but first_eos_block_idx
                # is a ROW index into the chosen slots, not an R index. Since
                # chosen[eos_row] >= eos_row, this also drops the unchosen
                # slots between R index eos_row and the EOS slot: those
                # positions are never generated (holes in the output).
                quirk_only = set(range(eos_row, chosen[eos_row])) - removed
                res.quirk_dropped_slots += len(quirk_only)
                removed |= set(range(eos_row, len(R)))
            R = [s for i, s in enumerate(R) if i not in removed]

        if stop_after_block:
            break

    gen = sorted(zip(committed_pos[P:], committed_ids[P:]))
    res.positions = [p for p, _ in gen]
    res.token_ids = [t for _, t in gen]
    res.tpf = res.sum_tpf / res.tpf_count
    return res


@torch.no_grad()
def ar_generate(model, prompt_ids: list[int], *, max_new_tokens: int, eos_id: int) -> list[int]:
    """Plain greedy autoregressive decoding with a KV cache (the AR baseline).

    Returns the new tokens, stopping right after EOS (EOS included) or after
    max_new_tokens.
    """
    if not prompt_ids:
        raise ValueError("empty prompt")
    device = model.device
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    pos = torch.arange(len(prompt_ids), device=device).unsqueeze(0)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True).logits
        nxt = int(logits[0, -1].argmax())
        out.append(nxt)
        if nxt == eos_id:
            break
        ids = torch.tensor([[nxt]], dtype=torch.long, device=device)
        pos = pos[:, -1:] + 1
    return out
