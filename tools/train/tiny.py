"""Train refusion-tiny: a small Qwen3ForCausalLM trained with the ReFusion objective on the
generated tasks of `refusion.tools.tasks`, small enough to ship in the repository.

One run of `train` is one stage; tools/train/recipe.sh runs the embedded model's ten (about 6 hours on
2 CPU cores at --threads 1; each resumes where it stopped if rerun; docs/training.md):

    nice -n 5 .venv/bin/python tools/train/tiny.py train [--stop-after N] [--init-from STATE]

The last stage writes models/refusion-tiny/ (config.json with mask_token_id, model.safetensors,
tokenizer.json, tokenizer_config.json, chat_template.jinja), loadable with
transformers' Qwen3ForCausalLM / AutoTokenizer. Training state and the log go to
--work-dir (default /tmp/refusion-tiny-train), never into the repository.

    .venv/bin/python tools/train/tiny.py eval --runtime   # accuracy per task (AR in torch; add's sum digits by place), then our runtime

The objective (docs/training.md, "Objective"; upstream `forward_process`),
with the choices docs/training.md lists: per example a slot size k; the response
(answer + <|im_end|>) padded with <|endoftext|> to a multiple of k, sometimes one more
all-pad slot; t ~ U(0,1), p = (1 - eps) t + eps; each slot masked with probability p; the
input is the prompt, the clean slots in shuffled order, then the masked slots (mask
tokens) in position order, every token with its true position id, attention causal in
sequence order. Loss = mean next-token cross-entropy over the clean slots' AR targets +
sum over masked tokens of CE / p / response length, over the batch size. With --prefix-prob (our
addition), that share of the examples is instead the response's first c tokens clean and in order and
masks after them (a decode's state after some commits), the masks' CE weighted by 1 / their count.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from refusion.tools import families
from refusion.tools import tasks as T
from refusion.tools.checks.fixtures.checkpoints import TinySpec, hf_config

REPO = Path(__file__).resolve().parents[2]
IGNORE = -100

# ----------------------------------------------------------------------------- tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>")
PAD, EOS, MASK = "<|endoftext|>", "<|im_end|>", "<|mask|>"
# Role names are single tokens (as in Qwen's BPE); tasks.py keeps them out of task text.
WORD_TOKENS = T.RESERVED_WORDS
# Qwen's tool tags, one token each as in its vocabulary (added after the specials: the older ids keep their rows)
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
CHARS = "\n\t" + "".join(chr(c) for c in range(32, 127))  # printable ASCII, one token each

# Qwen3-like, without thinking: <|im_start|>role\ncontent<|im_end|>\n ... <|im_start|>assistant\n. With `tools`, the
# system turn lists each function as one line of JSON, its name and its parameters' types (Qwen's own form writes
# each whole schema, too long for this model's 512 positions), between <tools> and </tools>; a call is
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> and a tool's result a user turn in <tool_response>.
CHAT_TEMPLATE = (
    "{%- if tools -%}"
    r"{{- '<|im_start|>system\n' -}}"
    r"{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\n' -}}{%- endif -%}"
    r"{{- '<tools>\n' -}}"
    "{%- for tool in tools -%}{%- set f = tool['function'] if tool['function'] is defined else tool -%}"
    "{%- set params = f['parameters'] if f['parameters'] is defined and f['parameters'] else {} -%}"
    "{%- set props = params['properties'] if params['properties'] is defined and params['properties'] else {} -%}"
    "{{- '{\"name\": ' + f['name'] | tojson + ', \"parameters\": {' -}}"
    "{%- for k in props -%}{{- k | tojson + ': ' + (props[k]['type'] or 'any') | tojson -}}"
    "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}{%- endfor -%}"
    r"{{- '}}\n' -}}"
    "{%- endfor -%}"
    r"{{- '</tools><|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' and loop.first and tools -%}"
    "{%- elif message['role'] == 'tool' -%}"
    r"{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' -}}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    r"{{- '<|im_start|>assistant\n' -}}{%- if message['content'] -%}{{- message['content'] + '\n' -}}{%- endif -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set c = call['function'] if call['function'] is defined else call -%}"
    r"{%- if not loop.first -%}{{- '\n' -}}{%- endif -%}"
    r"{{- '<tool_call>\n{\"name\": ' + c['name'] | tojson + ', \"arguments\": ' -}}"
    "{{- c['arguments'] if c['arguments'] is string else c['arguments'] | tojson -}}"
    r"{{- '}\n</tool_call>' -}}"
    "{%- endfor -%}"
    r"{{- '<|im_end|>\n' -}}"
    "{%- else -%}"
    r"{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def build_tokenizer():
    """A character-level tokenizer (the `tokenizers` library) wrapped for transformers."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    pieces = list(CHARS) + list(WORD_TOKENS) + list(SPECIAL_TOKENS) + list(TOOL_TOKENS)
    backend = Tokenizer(WordLevel({p: i for i, p in enumerate(pieces)}, unk_token=PAD))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_tokens([AddedToken(w, normalized=False, special=False) for w in WORD_TOKENS + TOOL_TOKENS])
    backend.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=PAD,
        mask_token=MASK,
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@dataclass(frozen=True)
class Ids:
    pad: int
    eos: int
    mask: int
    vocab: int


class Encoder:
    """Prompt and response ids, straight from the `tokenizers` backend (fast, no transformers call per example)."""

    def __init__(self, tok):
        self.backend = tok.backend_tokenizer
        self.ids = Ids(tok.convert_tokens_to_ids(PAD), tok.convert_tokens_to_ids(EOS),
                       tok.convert_tokens_to_ids(MASK), len(tok))
        self.tok = tok

    def prompt(self, text: str, before: list[dict[str, str]] = ()) -> list[int]:
        """The chat-templated prompt: `before` (system and earlier turns), then the user's text."""
        return self.chat([*before, {"role": "user", "content": text}])

    def chat(self, messages: list[dict], tools: tuple[dict, ...] = ()) -> list[int]:
        """A conversation chat-templated up to the assistant's turn, with the functions offered."""
        chat = self.tok.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                            add_generation_prompt=True)
        return self.backend.encode(chat, add_special_tokens=False).ids

    def example(self, ex: T.Example) -> list[int]:
        """An example's prompt: the family examples' conversation and tools, or the user's text alone."""
        return self.chat(ex.messages(), ex.tools)

    def response(self, answer: str) -> list[int]:
        return self.backend.encode(answer, add_special_tokens=False).ids + [self.ids.eos]

    def decode(self, ids: list[int]) -> str:
        if self.ids.eos in ids:
            ids = ids[: ids.index(self.ids.eos)]
        return self.backend.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- model


def build_model(args, vocab: int, ids: Ids):
    from transformers import Qwen3ForCausalLM

    spec = TinySpec(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, intermediate_size=args.intermediate, vocab_size=vocab,
                    rope_theta=args.rope_theta, max_positions=args.max_positions)
    config = hf_config(spec, ids.mask, ids.eos, rms_norm_eps=1e-6, attention_bias=False, use_sliding_window=False,
                       bos_token_id=None, pad_token_id=ids.pad, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config)


# ----------------------------------------------------------------------------- the ReFusion objective


def slot_size_choices(spec: str) -> tuple[list[int], list[float]]:
    """"4:0.3,8:0.3,16:0.2,32:0.2" -> ([4, 8, 16, 32], [0.3, 0.3, 0.2, 0.2])."""
    sizes, weights = [], []
    for part in spec.split(","):
        k, w = part.split(":")
        sizes.append(int(k))
        weights.append(float(w))
    return sizes, weights


@dataclass
class Sequence:
    ids: list[int]
    pos: list[int]
    ar: list[int]  # next-token targets (AR reading), IGNORE elsewhere
    mdm: list[int]  # own-position targets of mask tokens (diffusion reading), IGNORE elsewhere
    weight: float  # 1 / (p * response length) for this example's masked tokens


def padded_response(response: list[int], rng: random.Random, args, ids: Ids) -> tuple[int, list[int]]:
    """A slot size k drawn for the example and the response padded to whole slots, sometimes with one all-pad
    slot past the end (so masks beyond EOS learn to predict pad)."""
    sizes, weights = slot_size_choices(args.slot_sizes)
    k = rng.choices(sizes, weights)[0]
    span = math.ceil(len(response) / k) * k + (k if rng.random() < args.tail_slot_prob else 0)
    return k, response + [ids.pad] * (span - len(response))


def refusion_sequence(prompt: list[int], response: list[int], rng: random.Random, args, ids: Ids,
                      ordered_prob: float = 0.0) -> Sequence:
    k, resp = padded_response(response, rng, args, ids)
    span = len(resp)
    n_slots = span // k
    t = rng.random()
    p = (1 - args.eps) * t + args.eps
    ordered = rng.random() < ordered_prob  # a plain AR example: every slot clean, in position order
    masked = [False if ordered else rng.random() < p for _ in range(n_slots)]
    clean = [s for s in range(n_slots) if not masked[s]]
    if not ordered:
        rng.shuffle(clean)
    noisy = [s for s in range(n_slots) if masked[s]]

    p0 = len(prompt)
    seq_ids, pos = list(prompt), list(range(p0))
    ar, mdm = [IGNORE] * p0, [IGNORE] * p0
    for s in clean:
        chunk = resp[s * k:(s + 1) * k]
        seq_ids += chunk
        pos += range(p0 + s * k, p0 + (s + 1) * k)
        ar += chunk[1:] + [IGNORE]  # the last token of a slot: see the contiguity rule below
        mdm += [IGNORE] * k
    # Contiguity rule (our addition): a real token whose successor in the sequence also sits at
    # the next position gets it as its AR target: the prompt's last token when slot 0 comes
    # first, a slot's last token when the next slot in the shuffled order is its neighbour.
    # This trains the plain-AR reading at slot boundaries and right after the prompt.
    for j in range(p0 - 1, len(seq_ids) - 1):
        if ar[j] == IGNORE and pos[j + 1] == pos[j] + 1:
            ar[j] = seq_ids[j + 1]
    for s in noisy:
        seq_ids += [ids.mask] * k
        pos += range(p0 + s * k, p0 + (s + 1) * k)
        ar += [IGNORE] * k
        mdm += resp[s * k:(s + 1) * k]
    return Sequence(seq_ids, pos, ar, mdm, 1.0 / (p * span))


def prefix_sequence(prompt: list[int], response: list[int], rng: random.Random, args, ids: Ids,
                    first: int = 0) -> Sequence:
    """A decode's state after some commits: the response's first c tokens clean and in order (c drawn from
    `first` on), every position after them a mask (the plan reading with a committed prefix, and the first
    mask an infill row's re-draft of the token after its accepted ones)."""
    _, resp = padded_response(response, rng, args, ids)
    span = len(resp)
    c = rng.randrange(first, len(response))
    p0 = len(prompt)
    # with a prefix, the prompt's last token and each prefix token are trained on the token after them
    ar = ([IGNORE] * (p0 - 1) + resp[:c + 1]) if c else [IGNORE] * p0
    return Sequence(prompt + resp[:c] + [ids.mask] * (span - c), list(range(p0 + span)),
                    ar + [IGNORE] * (span - c), [IGNORE] * (p0 + c) + resp[c:], 1.0 / (span - c))


def collate(seqs: list[Sequence], ids: Ids, multiple: int = 8) -> dict[str, torch.Tensor]:
    """Right-pad to a common length (a multiple of `multiple`); pads are after every real token,
    so causal attention keeps them out of every real token's context."""
    length = max(len(s.ids) for s in seqs)
    length = -(-length // multiple) * multiple
    b = len(seqs)
    out = {
        "input_ids": torch.full((b, length), ids.pad, dtype=torch.long),
        "position_ids": torch.zeros((b, length), dtype=torch.long),
        "ar": torch.full((b, length), IGNORE, dtype=torch.long),
        "mdm": torch.full((b, length), IGNORE, dtype=torch.long),
        "weight": torch.tensor([s.weight for s in seqs], dtype=torch.float32),
    }
    for i, s in enumerate(seqs):
        n = len(s.ids)
        out["input_ids"][i, :n] = torch.tensor(s.ids)
        out["position_ids"][i, :n] = torch.tensor(s.pos)
        out["position_ids"][i, n:] = torch.arange(max(s.pos) + 1, max(s.pos) + 1 + length - n)
        out["ar"][i, :n] = torch.tensor(s.ar)
        out["mdm"][i, :n] = torch.tensor(s.mdm)
    return out


def refusion_loss(model, batch: dict[str, torch.Tensor], n_ar: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This micro-batch's share of the batch loss: AR CE summed / the batch's AR target count
    (so the shares add up to the batch mean), MDM CE * weight summed / the batch size."""
    # An explicit attention_mask: without one, transformers may read non-monotonic position ids
    # as packed sequences (its flash-attention paths do) and block attention between the slots.
    logits = model(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=torch.ones_like(batch["input_ids"]),
    ).logits.float()
    vocab = logits.shape[-1]
    ar_loss = F.cross_entropy(logits.view(-1, vocab), batch["ar"].view(-1), ignore_index=IGNORE, reduction="sum") / n_ar
    mdm_ce = F.cross_entropy(logits.view(-1, vocab), batch["mdm"].view(-1), ignore_index=IGNORE, reduction="none")
    weight = batch["weight"][:, None].expand_as(batch["mdm"]).reshape(-1)
    mdm_loss = (mdm_ce * weight).sum() / batch_size
    return ar_loss + mdm_loss, ar_loss.detach(), mdm_loss.detach()


def batch_for_step(step: int, enc: Encoder, args) -> list[Sequence]:
    """The batch of a step is a function of (seed, step) only: resuming replays nothing and skips nothing."""
    rng = random.Random(args.seed * 1_000_000_007 + step)
    tasks, weights = task_mix(args)
    mixed = any(t in families.FAMILIES for t in tasks)
    base = tuple(t for t in tasks if t in T.TASKS)
    base_weights = tuple(w for t, w in zip(tasks, weights) if t in T.TASKS)
    seqs = []
    for _ in range(args.batch_size):
        # (without a family in the mix a base example is drawn as the first seven stages drew theirs)
        task = rng.choices(tasks, weights)[0] if mixed else None
        if task in families.FAMILIES:  # its own conversation: no earlier turns drawn for it
            ex = families.training_example(rng, task)
            prompt = enc.example(ex)
        else:
            ex = T.training_example(rng, *((base, base_weights) if task is None else ((task,), None)))
            if ex.task == "lookup" and step < args.lookup_curriculum:
                ex = easier_lookup(rng, step / args.lookup_curriculum)
            before = conversation_before(rng, base, base_weights, args)
            prompt = enc.prompt(ex.prompt, before)
            while len(prompt) > args.max_prompt and before:  # too long: drop the oldest turn, then the system prompt
                before = before[2:] if before[0]["role"] == "user" else before[1:]
                prompt = enc.prompt(ex.prompt, before)
        response = enc.response(ex.answer)
        if step < args.ar_steps:
            seqs.append(refusion_sequence(prompt, response, rng, args, enc.ids, 1.0))
        elif args.prefix_prob and rng.random() < args.prefix_prob:
            # add's sum is what the masked reading has to learn; its operands are copied
            first = ex.answer.index("=") + 1 if ex.task == "add" and args.add_cut_in_sum else 0
            seqs.append(prefix_sequence(prompt, response, rng, args, enc.ids, first))
        else:
            seqs.append(refusion_sequence(prompt, response, rng, args, enc.ids, args.ordered_prob))
    return seqs


def easier_lookup(rng: random.Random, progress: float) -> T.Example:
    """A lookup of 2 keys and 1 query at progress 0, up to 2-9 keys and 1-8 queries at 1. Retrieval by
    key (an induction circuit) forms only after a long plateau on the full task; on small tables it forms
    early and then carries over (docs/training.md, "Recipe and why")."""
    grow = round(7 * progress)
    while True:
        prompt, answer = T.lookup_example(rng, (2, 2 + grow), (1, 1 + grow))
        if prompt not in T.held_out_prompts():
            return T.Example("lookup", prompt, answer)


def conversation_before(rng: random.Random, tasks, weights, args) -> list[dict[str, str]]:
    """What may precede the user's turn: a system prompt, earlier turns (other tasks, answered right)."""
    before: list[dict[str, str]] = []
    if rng.random() < args.system_prob:
        before.append({"role": "system", "content": T.system_prompt(rng)})
    if rng.random() < args.history_prob:
        for _ in range(rng.randint(1, 3)):
            turn = T.training_example(rng, tasks, weights)
            before += [{"role": "user", "content": turn.prompt}, {"role": "assistant", "content": turn.answer}]
    return before


def task_mix(args) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """--tasks "a,b,c" and --task-weights "b:2" -> (("a", "b", "c"), (1.0, 2.0, 1.0))."""
    tasks = tuple(args.tasks.split(","))
    unknown = set(tasks) - set(T.TASKS) - set(families.FAMILIES)
    if unknown:
        raise SystemExit(f"--tasks names {sorted(unknown)}; expected tasks {','.join(T.TASKS)} "
                         f"or families {','.join(families.FAMILIES)}")
    given = dict(part.split(":") for part in args.task_weights.split(",") if part)
    unknown = set(given) - set(tasks)
    if unknown:
        raise SystemExit(f"--task-weights names {sorted(unknown)}, not in --tasks {','.join(tasks)}")
    return tasks, tuple(float(given.get(t, 1.0)) for t in tasks)


def micro_batches(seqs: list[Sequence], n: int, ids: Ids) -> list[dict[str, torch.Tensor]]:
    """Sorted by length and cut into n micro-batches: far less padding than one padded batch."""
    order = sorted(seqs, key=lambda s: len(s.ids))
    size = -(-len(order) // n)
    return [collate(order[i:i + size], ids) for i in range(0, len(order), size)]


# ----------------------------------------------------------------------------- evaluation in torch


@torch.no_grad()
def greedy_ar(model, enc: Encoder, ids: list[list[int]], max_new: int = 64) -> list[str]:
    """Plain greedy autoregressive decoding of chat-templated prompts, batched with left padding and a KV cache."""
    from transformers import DynamicCache

    b, width = len(ids), max(map(len, ids))
    x = torch.full((b, width), enc.ids.pad, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    pos = torch.zeros((b, width), dtype=torch.long)
    for i, row in enumerate(ids):
        x[i, width - len(row):] = torch.tensor(row)
        attn[i, width - len(row):] = 1
        pos[i, width - len(row):] = torch.arange(len(row))
    lengths = torch.tensor([len(r) for r in ids])
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=x, attention_mask=attn, position_ids=pos, cache=cache, use_cache=True).logits
    nxt = logits[:, -1].argmax(-1)
    out = torch.full((b, max_new), enc.ids.eos, dtype=torch.long)
    done = torch.zeros(b, dtype=torch.bool)
    for step in range(max_new):
        out[:, step] = torch.where(done, enc.ids.eos, nxt)
        done |= nxt == enc.ids.eos
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones((b, 1), dtype=torch.long)], dim=1)
        logits = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=(lengths + step)[:, None],
                       cache=cache, use_cache=True).logits
        nxt = logits[:, -1].argmax(-1)
    return [enc.decode(row.tolist()) for row in out]


@torch.no_grad()
def one_shot_fill(model, enc: Encoder, prompts: list[str], span: int = 48) -> list[str]:
    """Diffusion reading in one forward: prompt + `span` masks, argmax at every mask (a probe of the planner)."""
    seqs = []
    for p in prompts:
        pr = enc.prompt(p)
        seqs.append(Sequence(pr + [enc.ids.mask] * span, list(range(len(pr) + span)), [], [], 0.0))
    batch = collate([Sequence(s.ids, s.pos, [IGNORE] * len(s.ids), [IGNORE] * len(s.ids), 0.0) for s in seqs], enc.ids)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=torch.ones_like(batch["input_ids"])).logits
    texts = []
    for i, s in enumerate(seqs):
        start = len(s.ids) - span
        texts.append(enc.decode(logits[i, start:len(s.ids)].argmax(-1).tolist()))
    return texts


@torch.no_grad()
def add_places(model, enc: Encoder, examples: list[T.Example]) -> dict[str, list[float]]:
    """add's sum digits by place (units first), teacher-forced and read three ways: "AR" (the answer fed
    clean, each digit from the logits before it), "mask" (the prompt then masks, each digit from its own
    mask, as a plan drafts it) and "draft" (the answer clean up to the digit, then its mask, as an infill
    row re-drafts a rejected token). Says which digits a model cannot yet compute, and in which reading."""
    hits: dict[str, defaultdict[int, list[int]]] = {r: defaultdict(lambda: [0, 0]) for r in ("AR", "mask", "draft")}

    def guesses(fed: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([fed]), position_ids=torch.arange(len(fed))[None]).logits[0].argmax(-1)

    for ex in (e for e in examples if e.task == "add"):
        prompt, response = enc.prompt(ex.prompt), enc.response(ex.answer)
        p0, first, end = len(prompt), ex.answer.index("=") + 1, len(ex.answer)
        ar, mask = guesses(prompt + response), guesses(prompt + [enc.ids.mask] * len(response))
        for j in range(first, end):
            draft = guesses(prompt + response[:j] + [enc.ids.mask])[-1]
            for reading, guess in (("AR", ar[p0 + j - 1]), ("mask", mask[p0 + j]), ("draft", draft)):
                place = hits[reading][end - 1 - j]
                place[0] += int(guess == response[j])
                place[1] += 1
    return {reading: [h / n for h, n in (table[p] for p in sorted(table))] for reading, table in hits.items()}


def accuracy_by_task(examples: list[T.Example], texts: list[str]) -> dict[str, float]:
    hits, counts = defaultdict(int), defaultdict(int)
    for ex, text in zip(examples, texts):
        counts[ex.task] += 1
        hits[ex.task] += T.score(ex, text)
    table = {t: hits[t] / counts[t] for t in T.TASKS + families.FAMILIES if counts[t]}
    table["all"] = sum(hits.values()) / max(1, sum(counts.values()))
    return table


def family_accuracy(examples: list[T.Example], texts: list[str]) -> dict[str, float]:
    """Accuracy per structured family (unguided: the model's own form)."""
    table = accuracy_by_task(examples, texts)
    table.pop("all")
    return table


def quick_eval(model, enc: Encoder, n: int, args) -> dict[str, dict[str, float]]:
    model.eval()
    examples = T.held_out(n)
    prompts = [e.prompt for e in examples]
    result = {
        "ar": accuracy_by_task(examples, greedy_ar(model, enc, [enc.prompt(p) for p in prompts])),
        "one_shot": accuracy_by_task(examples, one_shot_fill(model, enc, prompts)),
    }
    if any(t in families.FAMILIES for t in task_mix(args)[0]):
        held = [ex for f in families.FAMILIES for ex in families.held_out(f, n // 6)]
        result["ar"].update(family_accuracy(held, greedy_ar(model, enc, [enc.example(ex) for ex in held], max_new=128)))
    model.train()
    return result


def fmt_acc(table: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.2f}" for k, v in table.items())


# ----------------------------------------------------------------------------- training


HYPER = (  # what a saved state must agree on to be resumed
    "seed", "layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "rope_theta", "max_positions",
    "steps", "batch_size", "lr", "min_lr_ratio", "warmup", "weight_decay", "beta2", "grad_clip", "slot_sizes",
    "tail_slot_prob", "eps", "tasks", "task_weights", "lookup_curriculum", "ordered_prob", "ar_steps", "system_prob",
    "history_prob", "max_prompt", "init_from", "prefix_prob", "add_cut_in_sum", "init_weights",
)
HYPER_ADDED = {"prefix_prob": 0.0, "add_cut_in_sum": False, "init_weights": ""}  # hyperparameters newer than some saved states: their value before


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


class Log:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("a", encoding="utf-8")

    def __call__(self, msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.file.write(line + "\n")
        self.file.flush()


# The fastest benchmarked setting within a point of AR accuracy (docs/benchmark.md).
DECODE_DEFAULTS = {"gen_length": 64, "slot_size": 4, "serial_num_blocks": 4, "slot_threshold": 0.5,
                   "token_threshold": 0.1}


def save_state(path: Path, model, opt, step: int, args, elapsed: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                "hyper": {h: getattr(args, h) for h in HYPER}, "torch_rng": torch.get_rng_state()}, tmp)
    os.replace(tmp, path)


def save_model(model, tok, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("model.safetensors", "pytorch_model.bin"):
        (out / stale).unlink(missing_ok=True)
    model.config.use_cache = True
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # transformers 5 keeps the template in chat_template.jinja; older readers look in the config.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name transformers 4 and 5 both load
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    # The decode settings exports record as their defaults (docs/decoding.md, "Export defaults").
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text(encoding="utf-8"))
    gen["refusion_decode"] = DECODE_DEFAULTS
    gen_path.write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    for f in out.iterdir():
        f.chmod(0o644)


def init_state(model, opt, path: Path, log: Log) -> None:
    """A second stage starts from another run's saved state: its weights and Adam moments (the moments
    keep the first steps from lurching), under this run's own schedule, data and step count from 0."""
    if not path.is_file():
        sys.exit(f"--init-from {path}: no such state file; pass the state.pt of a run's --work-dir.")
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    log(f"initialized from {path} (step {state['step']} of its run, sha256 {digest})")


def init_weights(model, path: Path, log: Log) -> None:
    """A stage starts from a saved model's weights alone (fresh optimizer moments): the committed model, whose
    training states are gone. A vocabulary grown since (the tool tags) gets rows at the mean of the old ones, so the
    new tokens start as likely as an average token and as an average token's input."""
    from safetensors.torch import load_file

    file = path / "model.safetensors"
    if not file.is_file():
        sys.exit(f"--init-weights {path}: no model.safetensors there; pass a model directory tiny.py saved.")
    weights = load_file(file)
    own = model.state_dict()
    for name, tensor in weights.items():
        if tensor.shape[0] < own[name].shape[0] and name in ("model.embed_tokens.weight", "lm_head.weight"):
            grown = tensor.mean(0, keepdim=True).expand(own[name].shape[0] - tensor.shape[0], -1)
            weights[name] = torch.cat([tensor, grown])
    model.load_state_dict(weights)
    log(f"initialized from the weights of {path} (sha256 {hashlib.sha256(file.read_bytes()).hexdigest()})")


def train(args) -> None:
    # Bit-for-bit reproducible for a given --threads and CPU: eager ops only (two torch.compile'd
    # runs of the same command differed within 40 steps) and no nondeterministic kernels.
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    log = Log(work / "train.log")
    state_path = work / "state.pt"
    tok = build_tokenizer()
    enc = Encoder(tok)
    torch.manual_seed(args.seed)
    model = build_model(args, len(tok), enc.ids)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, args.beta2))
    step, elapsed0 = 0, 0.0
    if state_path.exists() and not args.restart:
        state = torch.load(state_path, weights_only=False)
        saved = {h: state["hyper"].get(h, HYPER_ADDED.get(h)) for h in HYPER}
        mismatch = {h: (saved[h], getattr(args, h)) for h in HYPER if saved[h] != getattr(args, h)}
        if mismatch:
            sys.exit(f"{state_path} was saved with other hyperparameters {mismatch} (saved, now); "
                     "pass --restart to start over, or the same flags to resume.")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed0 = state["step"], state["elapsed"]
        log(f"resumed from {state_path} at step {step}")
    elif args.init_from:
        init_state(model, opt, Path(args.init_from), log)
    elif args.init_weights:
        init_weights(model, Path(args.init_weights), log)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {args.layers} layers, hidden {args.hidden}, {n_params / 1e6:.2f}M parameters, vocab {len(tok)}; "
        f"{args.steps} steps of {args.batch_size}; work dir {work}")
    log("args: " + json.dumps({k: v for k, v in vars(args).items() if k != "func"}, sort_keys=True))
    model.train()
    t_start, tokens_seen, first_step = time.time(), 0, step
    loss_sum = ar_sum = mdm_sum = 0.0
    n_sum = 0
    stop = min(args.steps, args.stop_after or args.steps)
    while step < stop:
        seqs = batch_for_step(step, enc, args)
        n_tok = sum(len(s.ids) for s in seqs)
        n_ar = max(1, sum(sum(t != IGNORE for t in s.ar) for s in seqs))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        opt.zero_grad(set_to_none=True)
        loss = ar_l = mdm_l = 0.0
        for batch in micro_batches(seqs, args.micro_batches, enc.ids):
            part, ar_part, mdm_part = refusion_loss(model, batch, n_ar, len(seqs))
            part.backward()
            loss, ar_l, mdm_l = loss + float(part.detach()), ar_l + float(ar_part), mdm_l + float(mdm_part)
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        tokens_seen += n_tok
        loss_sum, ar_sum, mdm_sum, n_sum = loss_sum + loss, ar_sum + ar_l, mdm_sum + mdm_l, n_sum + 1
        if step % args.log_every == 0 or step == args.steps:
            now = time.time()
            run = now - t_start
            rate = tokens_seen / max(run, 1e-9)
            eta = (args.steps - step) * run / (step - first_step)
            log(f"step {step}/{args.steps} loss {loss_sum / n_sum:.4f} (ar {ar_sum / n_sum:.4f} mdm {mdm_sum / n_sum:.4f}) "
                f"lr {lr_at(step - 1, args):.2e} {rate:.0f} tok/s elapsed {fmt_time(elapsed0 + run)} ETA {fmt_time(eta)}")
            loss_sum = ar_sum = mdm_sum = 0.0
            n_sum = 0
        if step % args.save_every == 0 or step == stop:
            save_state(state_path, model, opt, step, args, elapsed0 + time.time() - t_start)
        if args.eval_every and (step % args.eval_every == 0 or step == args.steps):
            t0 = time.time()
            res = quick_eval(model, enc, args.eval_n, args)
            log(f"eval step {step} ({time.time() - t0:.0f}s) AR: {fmt_acc(res['ar'])}")
            log(f"eval step {step} one-shot fill: {fmt_acc(res['one_shot'])}")
    if step < args.steps:
        log(f"stopped at step {step} (--stop-after): {state_path} holds it; rerun without --stop-after to go on")
        return
    out = Path(args.out)
    save_model(model, tok, out)
    total = elapsed0 + time.time() - t_start
    weights = (out / "model.safetensors").read_bytes()
    log(f"done: {step} steps in {fmt_time(total)}; saved {out} ({len(weights) / 1e6:.1f} MB weights, "
        f"sha256 {hashlib.sha256(weights).hexdigest()})")


def fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# ----------------------------------------------------------------------------- evaluation command


def evaluate(args) -> None:
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = Encoder(tok)
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = T.held_out(args.n)
    prompts = [e.prompt for e in examples]
    rows: dict[str, dict[str, float]] = {}
    t0 = time.time()
    rows["torch AR (greedy)"] = accuracy_by_task(examples, greedy_ar(model, enc, [enc.prompt(p) for p in prompts]))
    print(f"torch AR: {fmt_acc(rows['torch AR (greedy)'])} ({time.time() - t0:.0f}s)", flush=True)
    rows["torch one-shot fill"] = accuracy_by_task(examples, one_shot_fill(model, enc, prompts))
    if TOOL_TOKENS[0] in tok.get_vocab():  # a model with the tool tags: the structured families too, unguided
        held = [ex for f in families.FAMILIES for ex in families.held_out(f, args.n // 3)]
        table = family_accuracy(held, greedy_ar(model, enc, [enc.example(ex) for ex in held], max_new=128))
        print(f"torch AR on the families ({args.n // 3} held-out examples each, unguided): {fmt_acc(table)}", flush=True)
    n_add = sum(e.task == "add" for e in examples)
    for reading, places in add_places(model, enc, examples).items():
        print(f"add's sum digits, units first, {reading} reading (teacher-forced, {n_add} prompts): "
              + " ".join(f"{100 * a:.0f}%" for a in places), flush=True)
    if args.runtime:
        rows.update(evaluate_runtime(args, examples))
    names = list(T.TASKS) + ["all"]
    print("\n| decode | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for label, table in rows.items():
        print(f"| {label} | " + " | ".join(f"{100 * table.get(n, float('nan')):.0f}" for n in names) + " |")


def evaluate_runtime(args, examples: list[T.Example]) -> dict[str, dict[str, float]]:
    from refusion.export.exporter import export_onnx
    from refusion.runtime.generator import Generator

    export_onnx(args.model, args.onnx_dir, force=True)
    rows = {}
    settings = [("ar", dict(mode="ar", gen_length=args.gen_length))]
    for spec in args.settings.split(";"):
        k, blocks, s_thr, t_thr = spec.split(",")
        settings.append((f"refusion k={k} blocks={blocks} slot>{s_thr} tok>{t_thr}",
                         dict(gen_length=args.gen_length, slot_size=int(k), serial_num_blocks=int(blocks),
                              slot_threshold=float(s_thr), token_threshold=float(t_thr))))
    with Generator.from_dir(args.onnx_dir, backend="ort-cpu", threads=args.threads) as gen:
        for label, params in settings:
            t0 = time.time()
            texts, tokens, forwards, tpf = [], 0, 0, 0.0
            for ex in examples:
                r = gen.generate(ex.prompt, chat=True, **params)
                texts.append(r.text)
                tokens += r.stats.tokens
                forwards += r.stats.forward_count
                tpf += r.stats.tpf
            table = accuracy_by_task(examples, texts)
            rows[f"runtime {label}"] = table
            print(f"runtime {label}: {fmt_acc(table)}; tokens/forward {tokens / max(1, forwards):.2f}, "
                  f"mean TPF {tpf / len(examples):.2f}, {time.time() - t0:.0f}s", flush=True)
    return rows


# ----------------------------------------------------------------------------- CLI


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train (or resume) and save models/refusion-tiny",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    tr.add_argument("--out", default=str(REPO / "models" / "refusion-tiny"))
    tr.add_argument("--work-dir", default="/tmp/refusion-tiny-train", help="training state and log")
    tr.add_argument("--restart", action="store_true", help="ignore a saved state and start over")
    tr.add_argument("--stop-after", type=int, default=0,
                    help="save the state at this step and stop, the schedule still that of --steps (a stage's source)")
    tr.add_argument("--init-from", default="",
                    help="start from another run's state.pt (weights and optimizer; docs/training.md's second stage)")
    tr.add_argument("--init-weights", default="",
                    help="start from a saved model directory's weights (fresh optimizer), the vocabulary grown to fit")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=1,
                    help="torch threads: with 2, a busy second core stalls every step (docs/training.md)")
    # model
    tr.add_argument("--layers", type=int, default=4)
    tr.add_argument("--hidden", type=int, default=192)
    tr.add_argument("--intermediate", type=int, default=512)
    tr.add_argument("--heads", type=int, default=4)
    tr.add_argument("--kv-heads", type=int, default=2)
    tr.add_argument("--head-dim", type=int, default=48)
    tr.add_argument("--rope-theta", type=float, default=10000.0)
    tr.add_argument("--max-positions", type=int, default=256)
    # optimisation
    tr.add_argument("--steps", type=int, default=6000)
    tr.add_argument("--batch-size", type=int, default=64)
    tr.add_argument("--micro-batches", type=int, default=4, help="the batch sorted by length and run in this many parts")
    tr.add_argument("--lr", type=float, default=2e-3)
    tr.add_argument("--min-lr-ratio", type=float, default=0.1)
    tr.add_argument("--warmup", type=int, default=60)
    tr.add_argument("--weight-decay", type=float, default=0.01)
    tr.add_argument("--beta2", type=float, default=0.98)
    tr.add_argument("--grad-clip", type=float, default=1.0)
    # objective and data
    tr.add_argument("--slot-sizes", default="4:0.3,8:0.3,16:0.2,32:0.2", help="slot size k: weight, drawn per example")
    tr.add_argument("--tail-slot-prob", type=float, default=0.5, help="chance of one extra all-pad slot after the response")
    tr.add_argument("--eps", type=float, default=1e-3, help="p = (1 - eps) t + eps")
    tr.add_argument("--prefix-prob", type=float, default=0.0,
                    help="after --ar-steps, the share of examples with a clean prefix and masks after it")
    tr.add_argument("--add-cut-in-sum", action="store_true",
                    help="an add prefix example's clean prefix ends inside the sum, not in the copied operands")
    tr.add_argument("--ar-steps", type=int, default=2500,
                    help="the first steps train the AR reading alone (every example plain AR), as upstream starts from Qwen3")
    tr.add_argument("--ordered-prob", type=float, default=0.2, help="after --ar-steps, the share of plain AR examples")
    tr.add_argument("--lookup-curriculum", type=int, default=2000,
                    help="lookups grow from 2 keys / 1 query to the full task over this many steps")
    tr.add_argument("--system-prob", type=float, default=0.15, help="chance of a system prompt before the user's turn")
    tr.add_argument("--history-prob", type=float, default=0.25, help="chance of 1-3 earlier turns (other tasks, answered)")
    tr.add_argument("--max-prompt", type=int, default=190, help="prompt tokens at most: earlier turns dropped to fit")
    tr.add_argument("--tasks", default=",".join(T.TASKS))
    tr.add_argument("--task-weights", default="add:2,lookup:3", help="task:weight for the tasks drawn more often (others 1)")
    # progress
    tr.add_argument("--log-every", type=int, default=10)
    tr.add_argument("--save-every", type=int, default=100)
    tr.add_argument("--eval-every", type=int, default=500)
    tr.add_argument("--eval-n", type=int, default=120)
    tr.set_defaults(func=train)

    ev = sub.add_parser("eval", help="accuracy per task on the held-out set",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ev.add_argument("--model", default=str(REPO / "models" / "refusion-tiny"))
    ev.add_argument("--n", type=int, default=210)
    ev.add_argument("--threads", type=int, default=2)
    ev.add_argument("--runtime", action="store_true", help="also export to ONNX and decode with the runtime (ort-cpu)")
    ev.add_argument("--onnx-dir", default="/tmp/refusion-tiny-onnx")
    ev.add_argument("--gen-length", type=int, default=64)
    ev.add_argument("--settings", default="8,1,0.9,0.4;4,1,0.9,0.4;8,1,0.7,0.2",
                    help="ReFusion settings 'slot_size,serial_num_blocks,slot_threshold,token_threshold;...'")
    ev.set_defaults(func=evaluate)
    return ap


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
