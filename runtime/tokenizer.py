"""Tokenizer and chat template for the runtime, without torch or transformers.

Reproduces `AutoTokenizer.from_pretrained(dir)` + `apply_chat_template(..., tokenize=False)`
of transformers 5 for Qwen2/Qwen3-style byte-level BPE checkpoints, using only the
`tokenizers` library and jinja2. The jinja environment mirrors transformers'
`_cached_compile_jinja_template`, so a checkpoint's template renders to the same text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, ClassVar

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend
from tokenizers.models import BPE

from refusion.runtime.chat_template import alias_reasoning, compile_template, plain, render
from refusion.runtime.core.errors import RefusionError
from refusion.runtime.core.signals import main_thread_signals

# Every tokenizer file a checkpoint may carry; the exporter copies those that exist.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "chat_template.jinja",
    "added_tokens.json",
)

# transformers' named special tokens; their strings are passed to every chat template.
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What Qwen2Tokenizer (the class Qwen2/Qwen3 configs name) assumes for keys the config omits.
_QWEN2_DEFAULTS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
# Qwen2's pre-tokenization regex, needed to rebuild the tokenizer from vocab.json + merges.txt.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")
# Unicode normalization (NFC, NFKC, lowercasing: the normalizers of this family's tokenizers) shrinks UTF-8
# text at most 3x: three Hangul jamo of 3 bytes compose into one syllable of 3, a fullwidth letter becomes ASCII.
_NORMALIZED_SHRINK = 3
_CHARACTER_BYTES = 4  # an unknown character becomes one token: at most 4 bytes of UTF-8


class Tokenizer:
    """Encode, decode and render chat prompts for one checkpoint's tokenizer directory."""

    _pool_started: ClassVar[bool] = False  # the tokenizers library's thread pool, one a process (`encode`)

    def __init__(self, backend: _Backend, special_tokens: dict[str, str], chat_template: str | dict | None):
        self._backend = backend
        # Named special tokens (eos_token, pad_token, ...) as strings, like transformers' special_tokens_map.
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        eos = special_tokens.get("eos_token")
        self.eos_token_id: int | None = backend.token_to_id(eos) if eos is not None else None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        root = Path(path)
        if not root.is_dir():
            raise RefusionError(
                f"tokenizer directory {str(root)!r} does not exist or is not a directory; "
                "pass the checkpoint or export folder that holds tokenizer.json or vocab.json + merges.txt"
            )
        config = _read_json(root / "tokenizer_config.json")  # optional, as for transformers
        if config is None:
            config = {}
        elif not isinstance(config, dict):
            raise _corrupt(root / "tokenizer_config.json", "its top level is not a JSON object")
        added = _added_tokens(root, config)  # may merge special_tokens_map.json into config
        backend = _load_backend(root)
        # Qwen2Tokenizer fills its defaults only for keys the config leaves out (an explicit null stays None).
        defaults = _QWEN2_DEFAULTS if str(config.get("tokenizer_class", "")).startswith("Qwen2Tokenizer") else {}
        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = _token_content(config[key] if key in config else defaults.get(key))
            if value is not None:
                special[key] = value
        _add_tokens(backend, added, special.values())
        # split_special_tokens=True makes transformers encode "<|im_end|>" in text as plain text.
        backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        return cls(backend, special, _read_chat_template(root, config))

    # --- tokens -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, as transformers' `tokenizer(text)["input_ids"]`."""
        # encode_batch gives the same ids and releases the GIL while it works (encode holds it), so a long
        # prompt tokenized on one thread does not stall the scheduler's. Its first call starts the tokenizers
        # library's thread pool, once for the process: inside main_thread_signals, so the pool takes no Ctrl-C.
        # Later calls start no thread and skip the mask (0.1 ms a request).
        if Tokenizer._pool_started:
            return self._backend.encode_batch([text])[0].ids
        with main_thread_signals():
            ids = self._backend.encode_batch([text])[0].ids
        Tokenizer._pool_started = True
        return ids

    def encode_short(self, text: str) -> list[int]:
        """`encode` of a short text on the calling thread, without the tokenizers library's pool (it holds the GIL
        for microseconds): what a grammar engine tokenizes, a guide's forced text, as often as tokens are decoded."""
        return self._backend.encode(text).ids

    @cached_property
    def longest_token_bytes(self) -> int:
        """At least the UTF-8 bytes of input text any one token stands for: the longest vocabulary entry in
        UTF-8 (byte-level alphabets spell each byte with one or two characters, so they over-count), or one
        unknown character."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max(_CHARACTER_BYTES, *(len(t.encode("utf-8", "surrogatepass")) for t in vocab))

    def max_text_bytes(self, tokens: int) -> int:
        """No text of more UTF-8 bytes than this tokenizes to `tokens` tokens or fewer: each token stands for at
        most `longest_token_bytes` of normalized text, and normalization shrinks text at most 3x."""
        return tokens * self.longest_token_bytes * _NORMALIZED_SHRINK

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # transformers skips its clean_up_tokenization step for BPE, so the backend's text is final.
        return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def token_bytes(self) -> tuple[list[bytes], list[int]]:
        """Each id's bytes, and the ids of the special tokens, as a grammar engine reads the vocabulary
        (runtime/structured/): a byte-level BPE token's bytes through its alphabet, an added token's its text's,
        any other token's the UTF-8 of its text."""
        added = self._backend.get_added_tokens_decoder()
        byte_level = isinstance(self._backend.decoder, decoders.ByteLevel)
        alphabet = {c: b for b, c in _byte_alphabet().items()}
        out = []
        for i in range(self.vocab_size):
            if i in added:
                out.append(added[i].content.encode())
            elif byte_level:
                out.append(bytes(alphabet[c] for c in self._backend.id_to_token(i) or ""))
            else:
                out.append(self._backend.decode([i], skip_special_tokens=False).encode())
        return out, sorted(i for i, token in added.items() if token.special)

    @property
    def vocab_size(self) -> int:
        """Number of ids including added tokens (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    # --- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = True,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text transformers' `apply_chat_template(..., tokenize=False)` renders.

        enable_thinking=None leaves the variable undefined in the template; other keyword
        arguments become template variables, as in transformers.
        """
        source = self._template_for(tools)
        if not messages:
            raise RefusionError("apply_chat_template got an empty conversation; pass at least one message")
        chat = []
        for message in messages:
            # transformers drops None-valued keys: templates treat a missing key better than a None one.
            message = plain(message)
            if not isinstance(message, dict):
                raise RefusionError(
                    f"chat message {message!r} is not a dict; pass messages like {{'role': 'user', 'content': '...'}}"
                )
            chat.append(alias_reasoning({k: v for k, v in message.items() if v is not None}))
        for name, items in (("tools", tools), ("documents", documents)):
            if items is not None and not all(isinstance(item, Mapping) for item in items):
                raise RefusionError(f"every entry of {name}= must be a dict (a JSON schema for tools); got {items!r}")
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        variables = {**self.special_tokens, **plain(kwargs)}  # caller's kwargs win, as in transformers
        template = compile_template(source)
        try:
            return render(template, dict(
                messages=chat,
                tools=plain(tools),
                documents=plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            ))
        except RefusionError:
            raise
        except Exception as e:
            raise RefusionError(
                f"the chat template failed on these messages: {type(e).__name__}: {e}; "
                "check the message roles/fields against the template, or pass raw text or token ids instead"
            ) from e

    def template(self, tools: bool = False) -> str:
        """The chat template's source that renders a conversation (with `tools`: one that offers functions)."""
        return self._template_for(True if tools else None)

    def _template_for(self, tools: object) -> str:
        template = self.chat_template
        if isinstance(template, dict):  # named templates; transformers' selection rule
            name = "tool_use" if tools is not None and "tool_use" in template else "default"
            if name not in template:
                raise RefusionError(
                    f"the checkpoint has chat templates {sorted(template)} but none named 'default'; "
                    "add a chat_template.jinja or pass raw text or token ids instead"
                )
            template = template[name]
        if not template:
            raise RefusionError(
                "the checkpoint has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); pass raw text or token ids instead of chat messages"
            )
        return template


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet, which byte-level BPE vocabularies are written in: printable bytes stand for
    themselves, the others for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = (b for b in range(256) if b not in printable)
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


# --- loading --------------------------------------------------------------------------------


def _corrupt(path: Path, why: str) -> RefusionError:
    return RefusionError(
        f"tokenizer file {str(path)!r} is corrupt ({why}); re-copy it from the original checkpoint "
        "or re-save the tokenizer with transformers' save_pretrained"
    )


def _read_json(path: Path) -> Any:
    """The parsed file, or None when it does not exist."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, str(e)) from e


def _token_content(value: Any) -> str | None:
    # Configs store special tokens as strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return None if value is None else str(value)


def _added_tokens(root: Path, config: dict) -> dict[int, AddedToken]:
    """Added tokens by id, read like transformers does: from the config, else from the legacy files."""
    if "added_tokens_decoder" in config:
        decoder = config["added_tokens_decoder"]
        try:
            return {
                int(i): AddedToken(**{k: t[k] for k in _ADDED_TOKEN_FIELDS if k in t}) for i, t in decoder.items()
            }
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            raise _corrupt(root / "tokenizer_config.json", f"bad added_tokens_decoder: {e}") from e
    # Legacy checkpoints: special_tokens_map.json overrides the config's named tokens...
    special_map = _read_json(root / "special_tokens_map.json") or {}
    config.update({k: v for k, v in special_map.items() if k in _SPECIAL_TOKEN_KEYS})
    # ...and added_tokens.json lists {token: id}; special ones are the named special tokens.
    specials = {_token_content(config.get(k)) for k in _SPECIAL_TOKEN_KEYS}
    added = _read_json(root / "added_tokens.json") or {}
    try:
        return {
            int(i): AddedToken(t, special=t in specials, normalized=t not in specials) for t, i in added.items()
        }
    except (AttributeError, TypeError, ValueError) as e:
        raise _corrupt(root / "added_tokens.json", f"expected {{token: id}}: {e}") from e


def _load_backend(root: Path) -> _Backend:
    path = root / "tokenizer.json"
    if path.is_file():
        try:
            return _Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise _corrupt(path, str(e)) from e
    vocab, merges = root / "vocab.json", root / "merges.txt"
    if not (vocab.is_file() and merges.is_file()):
        missing = [p.name for p in (vocab, merges) if not p.is_file()]
        raise RefusionError(
            f"tokenizer directory {str(root)!r} has no tokenizer.json and lacks {' and '.join(missing)}; "
            "copy the tokenizer files from the original checkpoint (tokenizer.json, or vocab.json + merges.txt)"
        )
    try:
        vocab_map, merge_list = BPE.read_file(str(vocab), str(merges))
    except Exception as e:
        raise _corrupt(vocab if "json" in str(e).lower() else merges, str(e)) from e
    # The pipeline transformers' Qwen2Tokenizer builds around vocab.json + merges.txt.
    backend = _Backend(BPE(vocab_map, merge_list, unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_tokens(backend: _Backend, added: dict[int, AddedToken], special: Iterable[str]) -> None:
    # In id order, so tokens appended after the BPE vocab land on the ids the config declares.
    for token_id, token in sorted(added.items()):
        if backend.token_to_id(token.content) is None:
            backend.add_tokens([token])
        got = backend.token_to_id(token.content)
        if got != token_id:
            raise RefusionError(
                f"added token {token.content!r} is declared with id {token_id} but the vocabulary gives it id {got}; "
                "the tokenizer files disagree, re-copy them together from the original checkpoint"
            )
    # Named special tokens that are not added tokens yet become special ones, as in transformers.
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    backend.add_tokens([AddedToken(c, special=True) for c in dict.fromkeys(special) if c not in present])


def _read_chat_template(root: Path, config: dict) -> str | dict | None:
    # transformers 5 saves chat_template.jinja and prefers it over the config's entry.
    path = root / "chat_template.jinja"
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise _corrupt(path, str(e)) from e
    template = config.get("chat_template")
    if isinstance(template, list):  # older multi-template form: [{"name": ..., "template": ...}]
        try:
            return {t["name"]: t["template"] for t in template}
        except (TypeError, KeyError) as e:
            raise _corrupt(root / "tokenizer_config.json", f"bad chat_template list: {e}") from e
    return template


# --- template data --------------------------------------------------------------------------
