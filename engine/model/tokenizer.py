"""Tokenizer built from a GGUF file's metadata, plus its chat template.

A GGUF carries no tokenizer.json: only the vocabulary, merges or scores, token types and the
name of the pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the Hugging Face `tokenizers`
pipeline the model was trained with from those. Two vocabulary kinds (`tokenizer.ggml.model`):

* `gpt2`, byte-level BPE (SmolLM2, Llama 3, Qwen2): the pre-tokenizer matters. SmolLM2's
  (`smollm`) splits every digit on its own before the GPT-2 regex, which changes how whitespace
  before a number is merged.
* `llama`, SentencePiece-style pieces with scores and `<0xNN>` byte fallback (Gemma, Llama 2,
  Mistral): see engine/model/spm_vocab.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterable, Sequence
from typing import Any

from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine.model import chat_templates
from engine.model.gguf_metadata import read_gguf_metadata
from engine.model.spm_vocab import SPECIAL_TYPES, add_whole_tokens, build_spm_backend, spm_piece_bytes

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# GPT-4o's (o200k) split, as in Phi-4-mini's tokenizer.json: a word is an optional non-letter, then upper-case
# letters and lower-case ones (so "camelCase" splits in two), then an optional contraction; numbers in 3s.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Mistral's tekken (Mistral Nemo, Small 3, Ministral): GPT-4o's split without its contractions, digits alone.
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback for files that name no known pre-tokenizer: four regex passes.
_LLAMACPP_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> the regex passes run before byte-level BPE (llama.cpp's table, same order).
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2_SPLIT,),
    "gpt-2": (_GPT2_SPLIT,),  # what llama.cpp's converter writes for GPT-2-style files
    "phi-2": (_GPT2_SPLIT,),
    "mpt": (_GPT2_SPLIT,),
    "olmo": (_GPT2_SPLIT,),
    "default": _LLAMACPP_DEFAULT_SPLITS,
    # SmolLM2 / StarCoder family: every digit alone, then the GPT-2 regex.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "pixtral": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
    "gpt-4o": (_GPT4O_SPLIT,),  # Phi-4-mini
    "tekken": (_TEKKEN_SPLIT,),
}
# Pre-tokenizers whose words found whole in the vocabulary are one token, whatever the merges would make of
# them (llama.cpp's `ignore_merges`, as these models' own tokenizer.json files say).
_IGNORE_MERGES = frozenset({"llama-bpe", "llama3", "llama-v3", "falcon3", "pixtral", "tekken"})

# Control tokens that end a turn in common chat formats, stopped on besides EOS.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
                       "<end_of_turn>")  # fmt: skip


def _pre_tokenizer(pre_type: str) -> pre_tokenizers.PreTokenizer:
    if pre_type == "smollm":
        # Exactly the pipeline of SmolLM2's own tokenizer.json.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre_type not in _PRE_SPLITS:
        supported = sorted(_PRE_SPLITS)
        raise ValueError(f"tokenizer.ggml.pre: unsupported pre-tokenizer {pre_type!r}; supported: {supported}")
    splits = [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in _PRE_SPLITS[pre_type]]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _bpe_backend(meta: dict[str, Any], tokens: list[str], token_types: list[int]) -> BackendTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    pre_type = meta.get("tokenizer.ggml.pre", "default")
    backend = BackendTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                          ignore_merges=pre_type in _IGNORE_MERGES))
    backend.pre_tokenizer = _pre_tokenizer(pre_type)
    backend.decoder = decoders.ByteLevel()
    add_whole_tokens(backend, tokens, token_types)  # <|im_start|> and the like: one id each
    return backend


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of bytes, reversed: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


@dataclasses.dataclass
class _Vocab:
    tokens: list[str]
    token_types: list[int]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    chat_template: str | None
    extra_stop_ids: tuple[int, ...]
    sentencepiece: bool = False  # pieces spell a space "▁" and bytes "<0xNN>"
    add_space_prefix: bool = False  # (sentencepiece) a "▁" was put before the text: strip it on decode


class Tokenizer:
    """Tokenizer (byte-level BPE or SentencePiece-style) + chat template of one GGUF model."""

    def __init__(self, backend: BackendTokenizer, vocab: _Vocab):
        self._backend = backend
        self._tokens = vocab.tokens
        self._token_types = vocab.token_types
        self._special_ids = frozenset(i for i, t in enumerate(vocab.token_types) if t in SPECIAL_TYPES)
        self._piece_bytes: list[bytes | None] = [None] * len(vocab.tokens)
        self._sentencepiece = vocab.sentencepiece
        self._strip_prefix_space = vocab.sentencepiece and vocab.add_space_prefix
        self.vocab_size = len(vocab.tokens)
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_id = vocab.eos_token_id
        self.add_bos = vocab.add_bos
        self.chat_template = vocab.chat_template
        ends = {i for i in self._special_ids if self._tokens[i] in _END_OF_TURN_TOKENS}
        self.stop_token_ids: set[int] = ({vocab.eos_token_id} if vocab.eos_token_id is not None else set()) | ends
        self.stop_token_ids |= set(vocab.extra_stop_ids)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, metadata: dict | None = None) -> Tokenizer:
        """The tokenizer a GGUF declares (`metadata`: the file's, if already read)."""
        meta = read_gguf_metadata(path) if metadata is None else metadata
        model = meta.get("tokenizer.ggml.model")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens or len(token_types) != len(tokens):
            raise ValueError("tokenizer.ggml.tokens: missing, or not one token type per token")
        sentencepiece = model == "llama"
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))  # llama.cpp's default
        if model == "gpt2":
            backend = _bpe_backend(meta, tokens, token_types)
        elif sentencepiece:
            scores = meta.get("tokenizer.ggml.scores") or []
            if len(scores) != len(tokens):
                raise ValueError("tokenizer.ggml.scores: a SentencePiece vocabulary needs one score per token")
            backend = build_spm_backend(tokens, scores, token_types, add_space_prefix=add_space_prefix)
        else:
            supported = "'gpt2' (byte-level BPE) and 'llama' (SentencePiece)"
            raise ValueError(f"tokenizer.ggml.model: supported are {supported}, got {model!r}")
        stop_keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        vocab = _Vocab(
            tokens=tokens,
            token_types=list(token_types),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            # llama.cpp's default when the key is absent: BOS for SentencePiece vocabularies only.
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", sentencepiece)),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_stop_ids=tuple(meta[k] for k in stop_keys if k in meta),
            sentencepiece=sentencepiece,
            add_space_prefix=add_space_prefix,
        )
        return cls(backend, vocab)

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; control-token markup in the text becomes single ids, and a BOS
        goes first if the file asks for one (`tokenizer.ggml.add_bos_token`) and add_special_tokens."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        # A chat template that writes the BOS itself (Gemma's does) must not get a second one.
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token_ids: id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if not self._sentencepiece:
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        text = b"".join(self.id_to_bytes(i) for i in ids).decode("utf-8", errors="replace")
        if self._strip_prefix_space and ids and ids[0] not in self._special_ids and text.startswith(" "):
            text = text[1:]  # the "▁" that encode put in front (llama.cpp's detokenize does the same)
        return text

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def id_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a piece may hold part of a UTF-8 character)."""
        piece = self._piece_bytes[token_id]
        if piece is None:
            token = self._tokens[token_id]
            if self._sentencepiece:
                piece = spm_piece_bytes(token, self._token_types[token_id])
            elif token_id in self._special_ids:
                piece = token.encode("utf-8")
            else:
                table = _byte_decoder()
                piece = bytes(table[c] for c in token) if all(c in table for c in token) else token.encode("utf-8")
            self._piece_bytes[token_id] = piece
        return piece

    def id_to_piece(self, token_id: int) -> str:
        """Readable token text for logprobs; a partial UTF-8 piece is shown as `bytes:\\xNN...`."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token_id: {token_id} outside the vocabulary [0, {self.vocab_size})")
        piece = self.id_to_bytes(token_id)
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)

    def backend_json(self) -> str:
        """The Hugging Face `tokenizers` pipeline as tokenizer.json text (what llguidance loads)."""
        return self._backend.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._tokens[self.bos_token_id] if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self._tokens[self.eos_token_id] if self.eos_token_id is not None else None

    # -- chat -----------------------------------------------------------------------------------

    def template_source(self) -> str:
        """The file's chat template, or the format its vocabulary implies when it carries none."""
        return self.chat_template or chat_templates.default_template(self._tokens)

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was tuned on (the file's template, or
        the format its vocabulary implies when it carries none); continue_final_message: ending inside
        the final message, right after its text (chat_templates.open_final)."""
        source = self.template_source()
        context = dict(kwargs, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return chat_templates.render(source, messages, add_generation_prompt, continue_final_message, **context)
