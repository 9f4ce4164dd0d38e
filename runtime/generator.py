"""`Generator`: the runtime's public face. Tokenize, decode on a Runner, detokenize, report.

    gen = Generator.from_dir("out/refusion-onnx", backend="auto")
    res = gen.generate("Write a function that ...", gen_length=512)  # settings left out: the export's defaults
    for piece in gen.stream(messages=[{"role": "user", "content": "..."}]): print(piece, end="")
    res = await gen.agenerate("...")                      # asyncio: agenerate, astream
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any

from refusion.runtime.core.errors import ContextLengthError, RefusionError
from refusion.runtime.core.export_manifest import ExportManifest
from refusion.runtime.core.profiles import DEFAULT_PREFILL_CHUNK
from refusion.runtime.decode import profile_needs, strategy
from refusion.runtime.decode.steps import Tokens
from refusion.runtime.options import RequestOptions
from refusion.runtime.params import DECODE_SETTINGS, DecodeParams
from refusion.runtime.prefix_cache import DEFAULT_MB, PrefixCache, check_prefix_cache_mb
from refusion.runtime.request import GenerationResult, GenerationStats, Request
from refusion.runtime.runners import make_runner
from refusion.runtime.runners.base import Runner
from refusion.runtime.scheduler import Scheduler
from refusion.runtime.structured.engine import BUDGET_MS, Grammar, Guides, Vocabulary, check_budget_ms
from refusion.runtime.structured.guide import Guide, guide_of
from refusion.runtime.structured.tools import Tools, check_template, read_tools
from refusion.runtime.tokenizer import Tokenizer

if TYPE_CHECKING:
    from refusion.runtime.decode.llada import DiffusionParams

__all__ = ["GenerationResult", "GenerationStats", "Generator", "GeneratorStatus"]


@dataclass(frozen=True)
class Resolved:
    """A request's keywords resolved once (Generator.options), what submit_ids runs: its decode settings, its
    request options, the functions it offers and the guide its answer follows, compiled (None: none)."""

    params: DecodeParams | DiffusionParams
    options: RequestOptions = RequestOptions()
    tools: Tools | None = None
    grammar: Grammar | None = None


@dataclass(frozen=True)
class PrefixCacheStatus:
    blocks: int  # blocks holding a prompt prefix's KV now
    bytes: int  # KV the cache's regions hold on the runner (at most its budget)
    hit_tokens: int  # prompt tokens copied from the cache instead of prefilled, since the Generator started


@dataclass(frozen=True)
class GeneratorStatus:
    """A Generator's state in one value, what frontends read (admission limits, health, metrics) instead of its
    scheduler's, runner's and cache's parts (nano-vllm's LLMEngine exposes counts the same way)."""

    alive: bool  # the scheduler thread runs (or has not been needed yet): submitted requests will be answered
    max_requests: int  # requests that run at once, a KV region each; more wait
    in_flight: int  # submitted and not ended: running or waiting
    regions_in_use: int  # KV regions running requests hold (0 once every request has ended)
    prefix_cache: PrefixCacheStatus | None  # None: the prefix cache is off


class Generator:
    """Thread-safe: any number of threads may share one Generator. Requests run on its scheduler
    thread (runtime/scheduler.py), concurrently up to the runner's KV regions, their forwards batched."""

    def __init__(self, manifest: ExportManifest, runner: Runner, tokenizer: Tokenizer | None,
                 prefix_cache_mb: float = DEFAULT_MB, prefill_chunk: int | None = None,
                 guide_budget_ms: float = BUDGET_MS):
        check_prefix_cache_mb(prefix_cache_mb)
        check_budget_ms(guide_budget_ms)
        self.guide_budget_ms = guide_budget_ms
        self.manifest = manifest
        self.runner = runner
        self.tokenizer = tokenizer
        self.prefix_cache = PrefixCache(runner, int(prefix_cache_mb * 2**20)) if prefix_cache_mb else None
        # The default bound where the runner feeds such a chunk over a past in one execution; engines built for
        # whole prefills do not (there a prefill over no past runs whole, one over a cached prefix in their chunks).
        takes = runner.chunk_bound("infiller", DEFAULT_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK, 1) is None
        self.prefill_chunk = resolve_prefill_chunk(prefill_chunk, runner.max_forward_tokens,
                                                   DEFAULT_PREFILL_CHUNK if takes else None)
        self.scheduler = Scheduler(runner, self.prefix_cache, self.prefill_chunk)
        # Text over this many UTF-8 bytes cannot fit the model's positions: refused before it is tokenized.
        self.max_prompt_bytes = tokenizer.max_text_bytes(manifest.max_positions) if tokenizer else 0
        self._guides: Guides | None = None  # the grammar engine over the vocabulary, made on the first guide

    @staticmethod
    def from_dir(path: str | Path, backend: str = "auto", threads: int | None = None, verify: bool = False,
                 low_memory: bool = False, max_requests: int | None = None, max_batch: int | None = None,
                 prefix_cache_mb: float = DEFAULT_MB, prefill_chunk: int | None = None,
                 guide_budget_ms: float = BUDGET_MS) -> Generator:
        """Load an export or engines directory; `verify` also checks every file's sha256 (a full read);
        `low_memory` (onnxruntime only): no memory arena, activations are freed after each forward (the
        weights are resident once either way). `max_requests` run at once (more wait), their forwards packed
        `max_batch` to a call (default 16 and 16 on onnxruntime CPU, the engine's --max-batch on TensorRT,
        1 and 1 on onnxruntime CUDA). `prefix_cache_mb`: the budget of the prefix cache, the KV of prompt
        prefixes that later requests reuse (0: off). `prefill_chunk`: the most tokens one forward feeds; a longer
        prompt is prefilled in chunks of it, other requests' forwards between them (default: DEFAULT_PREFILL_CHUNK,
        or the bound TensorRT engines were built with, --prefill-chunk, which they take at most; 0: off).
        `guide_budget_ms`: the grammar engine's work a guided request may take a token (docs/serving.md, "Guides");
        a request over it ends with an error naming its guide."""
        check_prefix_cache_mb(prefix_cache_mb)
        check_budget_ms(guide_budget_ms)
        resolve_prefill_chunk(prefill_chunk, None)  # a bad value is refused before anything loads
        manifest = ExportManifest.read(Path(path))
        manifest.check_files(verify, manifest.tokenizer_files)
        runner = make_runner(manifest, backend, threads, verify, low_memory, max_requests, max_batch)
        tokenizer = Tokenizer.from_dir(manifest.path) if manifest.tokenizer_files else None
        runner.activate()
        try:
            return Generator(manifest, runner, tokenizer, prefix_cache_mb, prefill_chunk, guide_budget_ms)
        except BaseException:
            runner.deactivate()
            raise

    def close(self) -> None:
        """Cancel what is in flight, stop the scheduler thread, release the backend."""
        self.scheduler.close()
        self.runner.deactivate()

    def status(self) -> GeneratorStatus:
        """Whether requests are answered, how many run and wait, the KV regions in use, the prefix cache's figures."""
        cache = self.prefix_cache
        return GeneratorStatus(
            alive=self.scheduler.alive, max_requests=self.runner.max_requests, in_flight=self.scheduler.in_flight,
            regions_in_use=self.scheduler.regions_in_use,
            prefix_cache=None if cache is None else PrefixCacheStatus(cache.blocks, cache.reserved_bytes,
                                                                       cache.stats.hit_tokens))

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
        tools: Tools | None = None,
    ) -> list[int]:
        """The prompt's token ids: text as it is, or through the chat template (`chat`, or `messages`, with the
        functions of `tools` offered where they are given), or ids as given."""
        given = sum(x is not None for x in (prompt, messages, prompt_ids))
        if given != 1:
            raise RefusionError("give exactly one of a prompt, messages, or prompt_ids.")
        if prompt is not None and not isinstance(prompt, str):
            raise RefusionError(f"prompt={prompt!r} is not a string; pass text, or token ids as prompt_ids=[...].")
        if messages is not None and not _is_chat(messages):
            raise RefusionError(f"messages={messages!r} is not a list of {{'role': ..., 'content': ...}} dicts (an "
                                "assistant's may carry tool_calls instead of content); pass e.g. "
                                "messages=[{'role': 'user', 'content': 'hi'}].")
        if tools is not None and messages is None and not chat:
            raise RefusionError("tools are offered through the chat template: pass messages=[...] (or chat=True).", "tools")
        if prompt_ids is not None:
            if chat:
                raise RefusionError("chat=True does not combine with prompt_ids: token ids are fed exactly as given, "
                                    "without the chat template; drop chat=True, or pass the prompt text instead.")
            ids = self._token_ids(prompt_ids)
        else:
            tok = self._tokenizer()
            if messages is None and chat:
                messages = [{"role": "user", "content": prompt}]
            for text in [prompt] if messages is None else [m.get("content") for m in messages]:
                if isinstance(text, str):
                    self._check_text(text)  # before a template copies it
            offered = tools.rendered if tools is not None else None
            if offered is not None:
                check_template(tok.template(tools=True), "this model")  # no path: a server sends it to clients
            text = (tok.apply_chat_template(messages, enable_thinking=enable_thinking, tools=offered) if messages
                    else prompt)
            ids = tok.encode(self._check_text(text or ""))
        if not ids:
            raise RefusionError("the prompt is empty; give at least one token of prompt.")
        return ids

    def fit_messages(self, messages: list[dict[str, Any]], *, enable_thinking: bool = True,
                     **options: Any) -> tuple[list[dict[str, Any]], int]:
        """A conversation cut to fit the model's positions with room for its answer (`options`: the request's
        decode settings). When it does not fit, its oldest turns (a user message and the answers after it)
        go, the leading system messages stay, until the prompt takes at most half of the room for prompts:
        the turns after it then reuse this prefix from the prefix cache for a while, where dropping one turn
        at a time would change the prefix every turn and prefill it whole. Returns the messages kept and how
        many were dropped; raises when even the last turn alone does not fit."""
        params = self.options(**options).params
        room = self.manifest.max_positions - strategy(params.mode).positions(params)

        def length(kept: list[dict[str, Any]]) -> int:
            try:
                return len(self.prompt_ids(messages=kept, enable_thinking=enable_thinking))
            except _TooManyBytes:  # more bytes than any prompt that fits: more tokens than any room
                return self.manifest.max_positions + 1

        if length(messages) <= room:
            return messages, 0
        system = list(itertools.takewhile(lambda m: m.get("role") == "system", messages))
        turns: list[list[dict[str, Any]]] = []
        for message in messages[len(system):]:
            if message.get("role") == "user" or not turns:
                turns.append([])
            turns[-1].append(message)
        while len(turns) > 1 and length(system + [m for t in turns for m in t]) > room // 2:
            turns.pop(0)
        kept = system + [m for t in turns for m in t]
        if length(kept) > room:
            raise ContextLengthError(
                f"the conversation's last turn takes {length(kept)} prompt tokens with the system messages, more than "
                f"the {room} the model's {self.manifest.max_positions} positions leave beside the answer; shorten it, "
                "or ask for fewer tokens.", context=self.manifest.max_positions, prompt=length(kept),
                completion=self.manifest.max_positions - room)
        return kept, len(messages) - len(kept)

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

    def _check_text(self, text: str) -> str:
        """`text` if it is UTF-8 text short enough to fit the positions; checked in bytes, before tokenizing."""
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise RefusionError(
                f"the prompt is not valid text: character {e.start} is a lone surrogate {text[e.start]!r} (what "
                "undecodable bytes become: input that is not UTF-8); send UTF-8 text.") from None
        if size > self.max_prompt_bytes:
            context, longest = self.manifest.max_positions, self._tokenizer().longest_token_bytes
            raise _TooManyBytes(
                f"This model's maximum context length is {context} tokens. However, the prompt is {size} bytes of "
                f"UTF-8, at least {-(-size // longest)} tokens (at most {longest} bytes a token). The prompt is too "
                f"long: no text over {self.max_prompt_bytes} bytes fits the model's positions; shorten it.",
                context=context, prompt=-(-size // longest), completion=1)
        return text

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise RefusionError(f"{self.manifest.path} carries no tokenizer files; pass prompt_ids (--prompt-ids) instead.")
        return self.tokenizer

    # -- generation ----------------------------------------------------------------------
    def params(self, **settings: Any) -> DecodeParams:
        """Decode settings; those left out (or None) take the values the export recorded for this model."""
        return DecodeParams.with_defaults(self.manifest.defaults, **settings)

    def options(self, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
                **options: Any) -> Resolved:
        """A request's keywords, checked and resolved once: its decode settings (DecodeParams; those left out take
        the export's recorded values), its request options (RequestOptions: stop, stop_token_ids, logprobs,
        timeout_s, a guide), the functions it offers (`tools`, `tool_choice`: Tools), and the guide its answer
        follows with them, compiled here: one the engine cannot enforce is refused before any work."""
        calls = read_tools(tools, tool_choice)
        asked = {name: options.pop(name) for name in RequestOptions.names() if name in options}
        unknown = [name for name in options if name not in DECODE_SETTINGS]
        if unknown:
            raise RefusionError(f"unknown setting {unknown[0]}={options[unknown[0]]!r}; the decode settings are "
                                f"{', '.join(DECODE_SETTINGS)} and the request options {', '.join(RequestOptions.names())}.")
        request = RequestOptions(**asked)
        if request.top_logprobs > self.manifest.candidates:
            raise RefusionError(f"top_logprobs={request.top_logprobs} exceeds the {self.manifest.candidates} candidates "
                                "this export's graphs emit; ask for fewer, or re-export with `refusion-export onnx ... "
                                f"--candidates {request.top_logprobs}`.", "top_logprobs")
        bad = [t for t in request.stop_token_ids if t >= self.manifest.vocab_size]
        if bad:
            raise RefusionError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.manifest.vocab_size}).", "stop_token_ids")
        params = self.params(**options)
        if params.top_k > self.manifest.candidates:
            raise RefusionError(f"top_k={params.top_k} exceeds the {self.manifest.candidates} candidates this export's "
                                f"graphs emit; lower top_k, or re-export with `refusion-export onnx ... --candidates "
                                f"{params.top_k}`.", "top_k")
        if request.stop and self.tokenizer is None:
            raise RefusionError(f"stop={list(request.stop)!r} needs the tokenizer to read the answer's text, and "
                                f"{self.manifest.path} carries none; stop at token ids (stop_token_ids) instead.", "stop")
        return Resolved(params, request, calls, self.grammar(request, calls))

    def grammar(self, options: RequestOptions, tools: Tools | None = None) -> Grammar | None:
        """The guide `options` ask for, as `tools` reads it with theirs (Tools.guide: a certain call, or a call or
        the typed answer), compiled (each guide once: the Generator caches them); None without one. A guide this
        export or the engine cannot enforce is a RefusionError naming its field."""
        guide = guide_of(options)
        if tools is not None:
            for each in tools.enforced():  # each function alone first, so a refusal names the function it is about
                self._enforceable(each)
            guide = tools.guide(guide)
        if guide is None:
            return None
        return self._enforceable(guide)

    def _enforceable(self, guide: Guide) -> Grammar:
        m = self.manifest
        if not m.takes_masks:
            raise RefusionError(f"{guide.field}: this model is an export of format {m.format_version}, whose graphs "
                                "cannot apply a guide (they take no vocab_mask); re-export it with this version: "
                                "`refusion-export onnx CHECKPOINT --output DIR --force` (engines: then rebuild them).", guide.field)
        return self.guides.compile(guide)

    @property
    def guides(self) -> Guides:
        """The grammar engine over this export's vocabulary and the guides it compiled: made on the first guide."""
        if self._guides is None:
            m, tok = self.manifest, self._tokenizer()
            token_bytes, special = tok.token_bytes()
            self._guides = Guides(Vocabulary(token_bytes, special, m.vocab_size, m.eos_token_id, tok.encode_short),
                                  budget_ms=self.guide_budget_ms)
        return self._guides

    def submit(self, prompt: str | None = None, *, messages=None, prompt_ids=None, chat: bool = False,
               enable_thinking: bool = True, tools: list[dict[str, Any]] | None = None, tool_choice: Any = None,
               **options: Any) -> Request:
        """Start a generation and return its handle at once: `.result()`, iteration over settled
        text, `.cancel()`, `.done`. `options`: decode settings (gen_length, max_tokens, slot_size, ...; left
        out, the export's) and request options (stop, stop_token_ids, logprobs, timeout_s: it ends with
        finish_reason "timeout" within one forward of the deadline; a guide: json_schema, regex, choice or
        grammar). `tools` (OpenAI's functions, offered through the chat template) and `tool_choice` ("auto",
        "none", "required" or {"type": "function", "function": {"name": ...}}): the result carries the calls in
        `tool_calls`. Bad input raises here, before anything runs."""
        resolved = self.options(tools, tool_choice, **options)  # a guide refused before the prompt is rendered
        ids = self.prompt_ids(prompt, messages=messages, prompt_ids=prompt_ids, chat=chat, enable_thinking=enable_thinking,
                              tools=resolved.tools)
        return self.submit_ids(ids, resolved, shrink=options.get("gen_length") is None)

    def check_fits(self, params: DecodeParams | DiffusionParams, prompt_tokens: int = 1,
                   shrink: bool = False) -> DecodeParams | DiffusionParams:
        """The params a prompt of `prompt_tokens` runs with, or their refusal (a RefusionError): too many positions
        (a ContextLengthError), or outside the backend's profiles. The one place a canvas is sized: where the one
        the settings ask for runs past the positions the prompt leaves, it is cut to them when max_tokens is
        given and fits, or when max_tokens is left out and `shrink` (gen_length is the export's, not the
        caller's): DecodeParams.sized, docs/decoding.md."""
        context = self.manifest.max_positions
        if isinstance(params, DecodeParams):
            params = params.sized(strategy(params.mode).positions(params), context - prompt_tokens, shrink)
        positions = strategy(params.mode).positions(params)
        if prompt_tokens + positions > context:
            raise _too_long(params, prompt_tokens, positions, context)
        needs = strategy(params.mode).profile_needs
        if self.prefill_chunk is not None and needs is not None:
            gen_length, _, blocks = needs(params)
            if gen_length // blocks > self.prefill_chunk:
                raise RefusionError(
                    f"a block of {gen_length // blocks} tokens exceeds prefill_chunk={self.prefill_chunk}, the most "
                    "tokens a forward feeds here: a plan or a verify forward feeds a whole block and cannot be cut; "
                    "lower the block (more serial_num_blocks, or a smaller gen_length) or load with a larger "
                    "prefill_chunk (--prefill-chunk).")
        self.runner.check_request(prompt_tokens, profile_needs(params), params.mode)
        return params

    def submit_ids(self, ids: list[int], resolved: Resolved | DecodeParams | DiffusionParams,
                   shrink: bool = False) -> Request:
        """Start a generation of these token ids as `resolved` (Generator.options; or bare params, any strategy's:
        decode.STRATEGIES, with no request options); `shrink`: gen_length is the export's, so with max_tokens left
        out the canvas may shrink to what the prompt leaves (check_fits)."""
        if not isinstance(resolved, Resolved):
            resolved = Resolved(resolved)
        params = self.check_fits(resolved.params, len(ids), shrink)
        options, grammar = resolved.options, resolved.grammar
        m = self.manifest
        detokenize = self.tokenizer.decode if self.tokenizer else None
        if grammar is not None and strategy(params.mode).guided is None:
            raise RefusionError(f"mode {params.mode!r} follows no guide (structured output); use mode refusion or ar.", "mode")
        bounds = [b for b in (self.runner.decode_tokens, self.prefill_chunk) if b is not None]
        tokens = Tokens(ids, m.mask_token_id, m.eos_token_id, top_logprobs=options.top_logprobs, guide=grammar,
                        feed_bound=min(bounds, default=None), lookahead=self.runner.guided_lookahead)
        request = Request(tokens, params, detokenize, self.runner.name, options, resolved.tools)
        return self.scheduler.submit(request)

    def generate(self, prompt: str | None = None, *, messages=None, prompt_ids=None, chat: bool = False,
                 enable_thinking: bool = True, **options: Any) -> GenerationResult:
        """`submit(...).result()`: the same keywords. With `timeout_s`, the result may end early: finish_reason
        "timeout", what had settled; with `stop`, at the first stop sequence: finish_reason "stop"."""
        return self.submit(prompt, messages=messages, prompt_ids=prompt_ids, chat=chat, enable_thinking=enable_thinking,
                           **options).result()

    def stream(self, prompt: str | None = None, *, messages=None, prompt_ids=None, chat: bool = False,
               enable_thinking: bool = True, **options: Any) -> Iterator[str]:
        """Text as the settled prefix grows: slots commit out of order, a reader sees only text
        whose every earlier position is committed, in order, up to the first EOS (not shown) or stop sequence
        (neither shown; text that could still begin one is held back). Closing the iterator early (break,
        Ctrl-C) cancels the request."""
        self._tokenizer()
        request = self.submit(prompt, messages=messages, prompt_ids=prompt_ids, chat=chat,
                              enable_thinking=enable_thinking, **options)
        try:
            yield from request
        finally:
            request.cancel()


    async def agenerate(self, prompt: str | None = None, *, messages=None, prompt_ids=None, chat: bool = False,
                        enable_thinking: bool = True, **options: Any) -> GenerationResult:
        """`generate` for asyncio: the same keywords; awaits the result without blocking the event loop, and
        cancelling the awaiting task cancels the request (it ends within one forward)."""
        request = self.submit(prompt, messages=messages, prompt_ids=prompt_ids, chat=chat,
                              enable_thinking=enable_thinking, **options)
        try:
            return await request.aresult()
        finally:
            request.cancel()  # a no-op once it has ended

    async def astream(self, prompt: str | None = None, *, messages=None, prompt_ids=None, chat: bool = False,
                      enable_thinking: bool = True, **options: Any) -> AsyncIterator[str]:
        """`stream` for asyncio (`async for piece in gen.astream(...)`); closing it early or cancelling the task
        that iterates it cancels the request."""
        self._tokenizer()
        request = self.submit(prompt, messages=messages, prompt_ids=prompt_ids, chat=chat,
                              enable_thinking=enable_thinking, **options)
        try:
            async for piece in request:
                yield piece
        finally:
            request.cancel()


def resolve_prefill_chunk(asked: int | None, engines: int | None, default: int | None = DEFAULT_PREFILL_CHUNK
                          ) -> int | None:
    """The bound a Generator runs with (None: none): `asked`, 0 for none, None for the default (the engines' bound
    where they were built with one, else `default`), within what the runner's engines take (their --prefill-chunk,
    which no bound, or a larger one, can go past)."""
    if asked is not None and (isinstance(asked, bool) or not isinstance(asked, Integral) or asked < 0):
        raise RefusionError(f"prefill_chunk={asked!r} (--prefill-chunk) must be a number of tokens, or 0 for none.")
    if asked is None:
        return engines if engines is not None else default
    bound = int(asked) or None
    if engines is not None and (bound is None or bound > engines):
        raise RefusionError(f"prefill_chunk={asked} asks for {'no bound' if bound is None else 'more'}, but these "
                            f"engines feed at most {engines} tokens a forward (built with --prefill-chunk {engines}); "
                            f"ask for at most {engines}, or rebuild them.")
    return bound


def _too_long(params: DecodeParams | DiffusionParams, prompt: int, positions: int, context: int) -> ContextLengthError:
    """The refusal of a prompt and an answer over the model's positions, in OpenAI's words ("This model's maximum
    context length is N tokens", which litellm matches; "prompt is too long", which LangChain matches where the
    openai client's error text carries the message alone, not the code), with what remains and what to lower."""
    room = context - prompt
    left = f"{_count(room, 'position')} {'remains' if room == 1 else 'remain'}"
    max_tokens = params.max_tokens if isinstance(params, DecodeParams) else None  # the benchmark's llada: none
    completion = max_tokens if max_tokens is not None else positions
    said = (f"This model's maximum context length is {context} tokens. However, you requested {prompt + completion} "
            f"tokens ({prompt} in the prompt, {completion} in the completion).")
    if room < 1:
        if max_tokens is None:  # a canvas of the export's would have been cut to fit: the prompt alone is too long
            completion = 1
            said = f"This model's maximum context length is {context} tokens. However, the prompt is {prompt} tokens."
        advice = (f"The prompt is too long: it leaves no position for an answer; shorten it to at most {context - 1} "
                  "tokens.")
    elif max_tokens is not None:
        advice = (f"The prompt is too long for that many: shorten it, or ask for at most {_count(room, 'token')} "
                  f"(max_tokens); {left} after it.")
    elif isinstance(params, DecodeParams):
        advice = (f"The prompt is too long for the canvas of {positions} positions the gen_length given asks for: "
                  f"shorten it, lower gen_length, ask for at most {_count(room, 'token')} (max_tokens: the canvas is "
                  f"then cut to fit) or leave gen_length out (the export's canvas is then cut to fit); "
                  f"{left} after this prompt.")
    else:
        advice = (f"The prompt is too long for gen_length {positions}: shorten it or lower gen_length; "
                  f"{left} after this prompt.")
    return ContextLengthError(f"{said} {advice}", context=context, prompt=prompt, completion=completion)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class _TooManyBytes(ContextLengthError):
    """A prompt over max_prompt_bytes (fit_messages takes it for a conversation too long, not an error)."""


def _is_chat(messages: Any) -> bool:
    return isinstance(messages, (list, tuple)) and all(
        isinstance(m, Mapping) and "role" in m and ("content" in m or "tool_calls" in m) for m in messages)
