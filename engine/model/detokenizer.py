"""Streaming token ids -> text deltas that never split a UTF-8 character.

A byte-level BPE token, or a SentencePiece `<0xNN>` byte-fallback token, may carry part of a
character (an emoji is often 2-4 tokens), so text can only be released once its bytes are
complete. Two strategies, same contract:

* exact bytes (tokenizers with `id_to_bytes`, as engine.model.tokenizer's): concatenate the
  token bytes and run them through an incremental UTF-8 decoder, which holds back exactly the
  bytes of an unfinished character. O(1) per token, never behind by more than 3 bytes.
* prefix/read offsets (any tokenizer with `decode`): decode a short window of ids, starting a
  few tokens before the new ones so context-dependent decoders (leading-space rules) see their
  left neighbour, and release the text past what was already released, holding back a trailing
  U+FFFD (an incomplete byte sequence decodes to exactly one). The window restarts at every
  clean character boundary.

Either way, the deltas plus `flush()` concatenate to `tokenizer.decode(output_ids)`; one
exception, SentencePiece files that put a "▁" before the text (Llama 2, Mistral): their `decode`
drops the leading space of a first "▁word" token, as a continuation's stream must not.
"""

from __future__ import annotations

import codecs
from typing import Any, Iterable, Sequence

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4  # prompt tokens decoded ahead of the first output token, for context


class IncrementalDetokenizer:
    """One request's detokenization state."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        exact_bytes: bool | None = None,
    ):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._vocab_size: int | None = getattr(tokenizer, "vocab_size", None)
        self._exact = hasattr(tokenizer, "id_to_bytes") if exact_bytes is None else exact_bytes
        self.num_output_tokens = 0
        if self._exact:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:]) if len(prompt_token_ids) else []
        if self._decode(context).endswith(_REPLACEMENT):
            context = []  # a prompt cut mid-character gives no usable left context
        self._ids = context  # [prefix window ... new ids]
        self._read_offset = len(context)  # ids before this are context, already released
        self._emitted = len(self._decode(context))  # chars of decode(self._ids) released so far

    def push(self, new_ids: Iterable[int]) -> str:
        """Text completed by `new_ids` (possibly empty while a character is still partial)."""
        new_ids = list(new_ids)
        for token_id in new_ids:
            if not isinstance(token_id, int) or token_id < 0 or (self._vocab_size and token_id >= self._vocab_size):
                raise ValueError(f"token_ids: invalid token id {token_id!r}")
        self.num_output_tokens += len(new_ids)
        if self._exact:
            return self._utf8.decode(self._bytes_of(new_ids))
        return self._push_window(new_ids)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished character), at the end of the stream."""
        if self._exact:
            return self._utf8.decode(b"", final=True)
        text = self._decode(self._ids)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _bytes_of(self, ids: list[int]) -> bytes:
        tok = self._tokenizer
        if self._skip_special:
            ids = [i for i in ids if not tok.is_special(i)]
        return b"".join(tok.id_to_bytes(i) for i in ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def _push_window(self, new_ids: list[int]) -> str:
        self._ids.extend(new_ids)
        text = self._decode(self._ids)
        stable = len(text) - 1 if text.endswith(_REPLACEMENT) else len(text)
        delta = text[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(text):
            # Clean boundary: the last tokens just read become the left context of the next window.
            del self._ids[: max(self._read_offset, len(self._ids) - _CONTEXT_TOKENS)]
            self._read_offset = len(self._ids)
            self._emitted = len(self._decode(self._ids))
        return delta
