"""SentencePiece-style vocabularies (`tokenizer.ggml.model == "llama"`): Gemma, Llama 2, Mistral.

The GGUF holds pieces, a score per piece and token types; no merges. llama.cpp tokenizes such a
vocabulary by starting from single characters and repeatedly joining the adjacent pair whose
concatenation is the highest-scoring piece (leftmost first on a tie); characters that end up in
no piece fall back to `<0xNN>` byte tokens. A BPE model does the same when its merges are every
split `(a, b)` of every piece `a + b`, ranked by that piece's score, so we build one with the
Hugging Face `tokenizers` library. Whitespace: every space becomes "▁" (U+2581), and files with
`tokenizer.ggml.add_space_prefix` (default true: Llama 2, Mistral; Gemma sets false) also get
one "▁" in front of each stretch of text, that is at the start and after every special token,
exactly as llama.cpp does. Control and user-defined tokens in the text are matched whole first.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as BackendTokenizer

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_BYTE = 6
SPECIAL_TYPES = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)  # matched whole in text when special
SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def spm_merges(tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, best-scoring piece first.

    Control (and unknown) tokens never take part: they are matched whole before the merges run.
    Among pieces of equal score the lower id ranks first, where llama.cpp takes the leftmost pair
    in the text; the two differ only when two such pieces overlap in one text (all of Gemma's
    pieces have distinct scores; in Llama 2 the ties are the 0-score byte pieces).
    """
    known = set(tokens)
    order = sorted(range(len(tokens)), key=scores.__getitem__, reverse=True)  # stable: ties keep id order
    merges: list[tuple[str, str]] = []
    append = merges.append  # ~1.5 M splits on Gemma's 262k pieces: keep the loop lean
    for i in order:
        token = tokens[i]
        if token_types[i] in SPECIAL_TYPES:
            continue
        for k in range(1, len(token)):
            left = token[:k]
            if left in known:
                right = token[k:]
                if right in known:
                    append((left, right))
    return merges


def build_spm_backend(
    tokens: Sequence[str], scores: Sequence[float], token_types: Sequence[int], *, add_space_prefix: bool
) -> BackendTokenizer:
    unknown = next((t for t, kind in zip(tokens, token_types, strict=True) if kind == TOKEN_TYPE_UNKNOWN), None)
    bpe = models.BPE(
        {token: i for i, token in enumerate(tokens)},
        spm_merges(tokens, scores, token_types),
        unk_token=unknown,
        byte_fallback=True,
    )
    backend = BackendTokenizer(bpe)
    # No pre-tokenizer: llama.cpp merges over the whole stretch of text, across spaces.
    steps = [normalizers.Prepend(SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPACE)])
    decoder_steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decoder_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decoder_steps)
    add_whole_tokens(backend, tokens, token_types)  # matched on the raw text, before the space escape
    return backend


def add_whole_tokens(backend: BackendTokenizer, tokens: Sequence[str], token_types: Sequence[int]) -> None:
    """Control and unknown tokens become special tokens and user-defined ones added tokens: each is
    matched whole in the text (one id), never split by the model's merges."""
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in typed if kind in SPECIAL_TYPES]
    )
    backend.add_tokens([AddedToken(t, normalized=False) for t, kind in typed if kind == TOKEN_TYPE_USER_DEFINED])


def spm_piece_bytes(token: str, token_type: int) -> bytes:
    """The bytes a piece stands for: `<0xNN>` is one byte, "▁" a space; control and user-defined
    tokens are their text as written (llama.cpp's token_to_piece)."""
    if token_type == TOKEN_TYPE_BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        return bytes([int(token[3:5], 16)])
    if token_type in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TOKEN_TYPE_UNKNOWN):
        return token.encode("utf-8")
    return token.replace(SPACE, " ").encode("utf-8")
