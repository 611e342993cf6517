"""Tokenizer built from a GGUF file's metadata, plus its chat template.

A GGUF carries no tokenizer.json: only the vocabulary, the merges, token types and the name of
the pre-tokenizer (`tokenizer.ggml.pre`). We rebuild the Hugging Face `tokenizers` pipeline the
model was trained with from those. The pre-tokenizer matters: SmolLM2's (`smollm`) splits every
digit on its own before the GPT-2 regex, which changes how whitespace before a number is merged.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from typing import Any, Iterable, Sequence

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine.model.model_files import read_gguf_metadata

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's fallback for files that name no known pre-tokenizer: four regex passes.
_LLAMACPP_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")

# tokenizer.ggml.pre -> the regex passes run before byte-level BPE (llama.cpp's table, same order).
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2_SPLIT,),
    "mpt": (_GPT2_SPLIT,),
    "olmo": (_GPT2_SPLIT,),
    "default": _LLAMACPP_DEFAULT_SPLITS,
    # SmolLM2 / StarCoder family: every digit alone, then the GPT-2 regex.
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "smaug-bpe": (_LLAMA3_SPLIT,),
    "dbrx": (_LLAMA3_SPLIT,),
    "falcon3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}

# A ChatML template for files that carry none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

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


class Tokenizer:
    """Byte-level BPE tokenizer + chat template of one GGUF model."""

    def __init__(self, backend: BackendTokenizer, vocab: _Vocab):
        self._backend = backend
        self._tokens = vocab.tokens
        self._special_ids = frozenset(i for i, t in enumerate(vocab.token_types) if t == TOKEN_TYPE_CONTROL)
        self._piece_bytes: list[bytes | None] = [None] * len(vocab.tokens)
        self.vocab_size = len(vocab.tokens)
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_id = vocab.eos_token_id
        self.add_bos = vocab.add_bos
        self.chat_template = vocab.chat_template
        ends = {i for i in self._special_ids if self._tokens[i] in _END_OF_TURN_TOKENS}
        self.stop_token_ids: set[int] = ({vocab.eos_token_id} if vocab.eos_token_id is not None else set()) | ends
        self.stop_token_ids |= set(vocab.extra_stop_ids)
        self._template: jinja2.Template | None = None

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> Tokenizer:
        meta = read_gguf_metadata(path)
        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ValueError(f"tokenizer.ggml.model: only byte-level BPE ('gpt2') is supported, got {model!r}")
        tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
        token_types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if not tokens or len(token_types) != len(tokens):
            raise ValueError("tokenizer.ggml.tokens: missing, or not one token type per token")
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        backend = BackendTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        typed = list(zip(tokens, token_types, strict=True))
        # Control tokens (<|im_start|> ...) must match whole, as one id, never split by BPE.
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind == TOKEN_TYPE_CONTROL]
        )
        backend.add_tokens([AddedToken(t, normalized=False) for t, kind in typed if kind == TOKEN_TYPE_USER_DEFINED])
        stop_keys = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        vocab = _Vocab(
            tokens=tokens,
            token_types=list(token_types),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            extra_stop_ids=tuple(meta[k] for k in stop_keys if k in meta),
        )
        return cls(backend, vocab)

    # -- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; control-token markup in the text becomes single ids."""
        if not isinstance(text, str):
            raise ValueError(f"text: expected a string, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token_ids: id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def id_to_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a piece may hold part of a UTF-8 character)."""
        piece = self._piece_bytes[token_id]
        if piece is None:
            token = self._tokens[token_id]
            if token_id in self._special_ids:
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

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self._tokens[self.bos_token_id] if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self._tokens[self.eos_token_id] if self.eos_token_id is not None else None

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Any], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to the prompt text the model was tuned on."""
        if self._template is None:
            self._template = _compile_template(self.chat_template or CHATML_TEMPLATE)
        context = dict(kwargs, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        try:
            return self._template.render(
                messages=_normalize_messages(messages), add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"messages: the chat template rejected the conversation: {exc}") from exc


def _normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Plain dicts with string roles and contents (OpenAI text parts joined)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages: expected a non-empty list of {role, content} messages")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            message = {name: getattr(message, name) for name in ("role", "content", "name") if hasattr(message, name)}
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role: expected a string")
        if content is None:
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string or a list of text parts")
        result.append({k: v for k, v in dict(message, role=role, content=content).items() if v is not None})
    return result


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def _compile_template(source: str) -> jinja2.Template:
    """Same environment settings as transformers, so templates render byte-identically."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: invalid Jinja template: {exc}") from exc
