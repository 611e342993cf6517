"""SentencePiece-style vocabularies (`tokenizer.ggml.model == "llama"`).

The real Gemma 3 270M file against llama.cpp's ids, decodes and chat format, recorded by
tests/fixtures/make_spm_golden.py (llama.cpp is not needed here); then tiny vocabularies written
here for the rules Gemma does not exercise: the "▁" put before the text by Llama 2 / Mistral
files, the score order of merges, and byte fallback.
"""

from __future__ import annotations

import json
import pathlib
import random

import gguf
import pytest

from engine.model.detokenizer import IncrementalDetokenizer
from engine.model.model_files import KNOWN_MODELS, resolve_model
from engine.model.tokenizer import Tokenizer

GOLDEN = json.loads((pathlib.Path(__file__).parent / "fixtures" / "gemma3_tokenizer_golden.json").read_text())
TEXTS = GOLDEN["texts"]
STREAM_TEXTS = [
    "Emoji 😀👍🏽🇺🇸❤️‍🔥, a flamingo 🦩, a troll 🧌, mahjong 🀄 and 𝔘𝕏",
    "中文：你好，世界！日本語のテキスト、한국어 텍스트, rare 龘䨻𪚥𰻞 ꙮ",
]


@pytest.fixture(scope="session")
def gemma() -> Tokenizer:
    """The real gemma3-270m vocabulary (fetched into the cache on first use)."""
    return Tokenizer.from_gguf(resolve_model("gemma3-270m"))


def test_golden_is_for_the_known_file():
    assert GOLDEN["model_sha256"] == KNOWN_MODELS["gemma3-270m"].sha256
    assert len(TEXTS) >= 30 and len(GOLDEN["chats"]) >= 2


@pytest.mark.parametrize("case", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_llama_cpp(gemma, case):
    assert gemma.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", TEXTS, ids=range(len(TEXTS)))
def test_decode_matches_llama_cpp_and_round_trips(gemma, case):
    ids = case["ids"]
    assert gemma.decode(ids[1:]) == case["decoded"]
    assert gemma.decode(ids) == "<bos>" + case["decoded"]
    if "\u2581" not in case["text"]:  # a literal "▁" is a space to SentencePiece, both ways
        assert case["decoded"] == case["text"]


@pytest.mark.parametrize("case", GOLDEN["chats"], ids=range(len(GOLDEN["chats"])))
def test_gemma_chat_format_matches_llama_cpp(gemma, case):
    """The file carries no template: Gemma's format comes from the vocabulary. Ours writes the
    BOS as Gemma's own template does; llama.cpp's built-in leaves it to the tokenizer."""
    assert gemma.chat_template is None
    rendered = gemma.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered == "<bos>" + case["rendered_llama_cpp"]
    assert gemma.encode(rendered) == case["ids"]  # one BOS, not two


def test_gemma_chat_roles_must_alternate(gemma):
    with pytest.raises(ValueError, match="alternate"):
        gemma.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_gemma_special_tokens_and_stops(gemma):
    assert gemma.vocab_size == 262_144 and gemma.add_bos
    assert (gemma.bos_token, gemma.eos_token) == ("<bos>", "<eos>")
    turn_start, turn_end = gemma.token_to_id("<start_of_turn>"), gemma.token_to_id("<end_of_turn>")
    assert gemma.stop_token_ids == {gemma.eos_token_id, turn_end}
    for token in ("<start_of_turn>", "<end_of_turn>", "<eos>", "<pad>", "<unused7>"):
        token_id = gemma.token_to_id(token)
        assert gemma.encode(token) == [gemma.bos_token_id, token_id] and gemma.is_special(token_id)
        assert gemma.encode(f"a{token}b") == [gemma.bos_token_id, *gemma.encode("a")[1:], token_id,
                                              *gemma.encode("b")[1:]]  # fmt: skip
    assert gemma.encode("<bos>hi") == gemma.encode("hi")  # no second BOS
    ids = gemma.encode("<start_of_turn>model\nHi!<end_of_turn>")
    assert ids[:2] == [gemma.bos_token_id, turn_start]
    assert gemma.decode(ids, skip_special_tokens=True) == "model\nHi!"


def test_gemma_piece_bytes(gemma):
    space_word = gemma.encode("a big")[2]  # "▁big"
    assert gemma.id_to_bytes(space_word) == b" big" and gemma.id_to_piece(space_word) == " big"
    byte_ids = gemma.encode("龘")[1:]
    assert [gemma.id_to_bytes(i) for i in byte_ids] == [bytes([b]) for b in "龘".encode()]
    assert gemma.id_to_piece(byte_ids[0]) == "bytes:\\xe9"
    assert gemma.id_to_bytes(gemma.token_to_id("<end_of_turn>")) == b"<end_of_turn>"
    assert gemma.id_to_bytes(gemma.token_to_id("\n\n")) == b"\n\n"  # user-defined: as written


@pytest.mark.parametrize("exact", [True, False], ids=["exact_bytes", "offset_window"])
@pytest.mark.parametrize("text", STREAM_TEXTS, ids=["emoji", "cjk"])
def test_streaming_never_splits_a_character(gemma, text, exact):
    ids = gemma.encode(text)[1:]
    assert sum(len(gemma.id_to_bytes(i)) == 1 and gemma.id_to_bytes(i)[0] >= 0x80 for i in ids) >= 6  # byte fallback
    rng = random.Random(0)
    detok = IncrementalDetokenizer(gemma, gemma.encode("Say: "), exact_bytes=exact)
    deltas, start = [], 0
    while start < len(ids):
        size = rng.randint(1, 3)
        deltas.append(detok.push(ids[start : start + size]))
        start += size
    assert "".join(deltas) + detok.flush() == text
    assert "" in deltas and not any("\ufffd" in d for d in deltas)


# -- tiny vocabularies written here ------------------------------------------------------------------

BYTES = [f"<0x{b:02X}>" for b in range(256)]
# piece: score, higher merges first. The pieces expected below were checked once against llama.cpp.
PIECES = {
    "ll": -1.0, "he": -2.0, "▁he": -3.0, "llo": -4.0, "▁hello": -5.0, "▁w": -6.0, "or": -7.0, "ld": -8.0,
    "▁wor": -9.0, "▁": -10.0, "h": -11.0, "e": -12.0, "l": -13.0, "o": -14.0, "w": -15.0, "r": -16.0, "d": -17.0,
}  # fmt: skip
TINY_TOKENS = ["<unk>", "<s>", "</s>", *BYTES, *PIECES]


def _write_spm_gguf(path: pathlib.Path, *, add_space_prefix: bool | None) -> pathlib.Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_scores([0.0, 0.0, 0.0] + [0.0] * 256 + list(PIECES.values()))
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(PIECES))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_space_prefix is not None:  # absent: llama.cpp's default, true (Llama 2, Mistral)
        writer.add_add_space_prefix(add_space_prefix)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [TINY_TOKENS[i] for i in tokenizer.encode(text)]


def test_llama2_style_prefix_space_merges_and_byte_fallback(tmp_path):
    tokenizer = Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=None))
    assert tokenizer.add_bos  # the SentencePiece default when the file does not say
    # ll, he, ▁he, llo, then ▁hello: highest score first; ▁world stops at ▁wor + ld (no ▁world piece).
    assert _pieces(tokenizer, "hello world") == ["<s>", "▁hello", "▁wor", "ld"]
    # A "▁" before every stretch of text: at the start and after each special token.
    assert _pieces(tokenizer, "hello</s>hello") == ["<s>", "▁hello", "</s>", "▁hello"]
    assert _pieces(tokenizer, "<s>hello") == ["<s>", "▁hello"]
    assert _pieces(tokenizer, "heé") == ["<s>", "▁he", "<0xC3>", "<0xA9>"]  # é: not a piece, two bytes
    assert _pieces(tokenizer, "") == ["<s>"]
    assert _pieces(tokenizer, " hello") == ["<s>", "▁", "▁hello"]  # the text's own space, then the added one
    ids = tokenizer.encode("hello world heé")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "hello world heé"  # the added "▁" is dropped
    assert tokenizer.decode(ids) == "<s> hello world heé"
    assert tokenizer.id_to_bytes(ids[1]) == b" hello" and tokenizer.id_to_bytes(ids[-1]) == b"\xa9"
    assert tokenizer.stop_token_ids == {2} and not tokenizer.is_special(ids[1]) and tokenizer.is_special(0)
    detok = IncrementalDetokenizer(tokenizer, ids[:1])
    assert [detok.push([i]) for i in ids[1:]] == [" hello", " wor", "ld", " he", "", "é"]


def test_gemma_style_no_prefix_space(tmp_path):
    tokenizer = Tokenizer.from_gguf(_write_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False))
    assert _pieces(tokenizer, "hello world") == ["<s>", "he", "llo", "▁wor", "ld"]
    assert _pieces(tokenizer, "</s>hello") == ["<s>", "</s>", "he", "llo"]
    assert _pieces(tokenizer, " hello") == ["<s>", "▁hello"]
    assert tokenizer.decode(tokenizer.encode(" hello"), skip_special_tokens=True) == " hello"
    with pytest.raises(ValueError, match="text"):
        tokenizer.encode(b"bytes")
