"""Incremental detokenization: deltas concatenate to the full decode, never split a character.

Both strategies are checked (exact bytes, and the generic prefix/read-offset window), with the
tokenizer's own `decode` of the whole stream as the reference.
"""

from __future__ import annotations

import json
import pathlib
import random

import pytest

from engine.model.detokenizer import IncrementalDetokenizer

GOLDEN = json.loads((pathlib.Path(__file__).parent / "fixtures" / "tokenizer_golden.json").read_text())
VALID_TEXTS = [c["text"] for c in GOLDEN["texts"] if c["roundtrip"] and c["text"]] + [
    "Mixed: naïve café 😀🎉 中文混合 English, 日本語とEnglish, 한국어! ✓ ∑x² ≤ ∞ 🇯🇵🏳️‍🌈" * 3,
    "<|im_start|>assistant\n你好！我是一个助手。😊<|im_end|>",
]
MODES = [pytest.param(True, id="exact_bytes"), pytest.param(False, id="offset_window")]


def _stream(tokenizer, ids, chunks, *, exact, skip=True, prompt=()):
    detok = IncrementalDetokenizer(tokenizer, list(prompt), skip_special_tokens=skip, exact_bytes=exact)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    assert start >= len(ids)
    return deltas, detok.flush()


def _chunk_sizes(num_ids, rng, max_size):
    return [rng.randint(1, max_size) for _ in range(num_ids)]  # more than enough; extra pushes are empty


@pytest.mark.parametrize("exact", MODES)
@pytest.mark.parametrize("max_chunk", [1, 2, 5])
@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_full_decode(tokenizer, exact, max_chunk, skip):
    rng = random.Random(max_chunk)
    for text in VALID_TEXTS:
        ids = tokenizer.encode(text)
        prompt = tokenizer.encode("Prompt: say something. ")
        deltas, tail = _stream(tokenizer, ids, _chunk_sizes(len(ids), rng, max_chunk), exact=exact, skip=skip,
                               prompt=prompt)  # fmt: skip
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip), text
        assert tail == ""
        assert not any("\ufffd" in d for d in deltas), text


@pytest.mark.parametrize("exact", MODES)
def test_text_is_released_as_soon_as_each_character_completes(tokenizer, exact):
    """After every token, released text == decode(ids so far) minus an unfinished last character."""
    text = "Emoji 😀👍🏽 and CJK 中文测试 and ZWJ 👨‍👩‍👧 end"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [], exact_bytes=exact)
    released = ""
    for k, token_id in enumerate(ids, start=1):
        released += detok.push([token_id])
        assert released == tokenizer.decode(ids[:k]).removesuffix("\ufffd")
    assert released == text


@pytest.mark.parametrize("exact", MODES)
def test_unfinished_character_is_flushed_at_the_end(tokenizer, exact):
    ids = tokenizer.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte is missing
    deltas, tail = _stream(tokenizer, cut, [1] * len(cut), exact=exact)
    assert "".join(deltas) == "ok "
    assert "".join(deltas) + tail == tokenizer.decode(cut) and tail.endswith("\ufffd")


@pytest.mark.parametrize("exact", MODES)
def test_arbitrary_token_streams_match_decode(tokenizer, exact):
    """Random ids, heavy on lone byte tokens (invalid UTF-8 too): still exactly `decode`."""
    rng = random.Random(1234)
    byte_ids = [tokenizer.token_to_id(c) for c in map(chr, [*range(0x21, 0x7F), *range(0xA1, 0x100)])]
    byte_ids += [tokenizer.token_to_id(chr(0x100 + i)) for i in range(68)]
    byte_ids = [i for i in byte_ids if i is not None]
    for trial in range(200):
        ids = [rng.choice(byte_ids) if rng.random() < 0.6 else rng.randrange(tokenizer.vocab_size)
               for _ in range(rng.randint(1, 30))]  # fmt: skip
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 6))]
        skip = trial % 2 == 0
        deltas, tail = _stream(tokenizer, ids, _chunk_sizes(len(ids), rng, 4), exact=exact, skip=skip, prompt=prompt)
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=skip), ids


@pytest.mark.parametrize("exact", MODES)
def test_special_tokens_are_skipped_or_kept(tokenizer, exact):
    ids = tokenizer.encode("Hi!<|im_end|>")
    for skip, expected in ((True, "Hi!"), (False, "Hi!<|im_end|>")):
        deltas, tail = _stream(tokenizer, ids, [1] * len(ids), exact=exact, skip=skip)
        assert "".join(deltas) + tail == expected


def test_offset_window_stays_small_on_long_streams(tokenizer):
    text = " ".join(VALID_TEXTS) * 4
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt"), exact_bytes=False)
    longest = 0
    for token_id in ids:
        detok.push([token_id])
        longest = max(longest, len(detok._ids))
    assert len(ids) > 1000 and longest <= 12


@pytest.mark.parametrize("bad", [-1, 49152, 1.5, "7"])
def test_invalid_ids_raise_value_error(tokenizer, bad):
    with pytest.raises(ValueError, match="token_ids"):
        IncrementalDetokenizer(tokenizer, []).push([bad])
