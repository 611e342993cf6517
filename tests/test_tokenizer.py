"""Tokenizer vs the reference fixtures made by scripts/make_golden.py (transformers), plus
pre-tokenizer and error behaviour on tiny GGUF files written here."""

from __future__ import annotations

import json
import pathlib
import types

import gguf
import pytest

from engine.model.tokenizer import Tokenizer, _byte_decoder

GOLDEN = json.loads((pathlib.Path(__file__).parent / "fixtures" / "tokenizer_golden.json").read_text())
TEXTS = GOLDEN["texts"]
CHATS = GOLDEN["chats"]


@pytest.mark.parametrize("case", TEXTS, ids=range(len(TEXTS)))
def test_encode_matches_reference(tokenizer, case):
    assert tokenizer.encode(case["text"]) == case["ids"]


@pytest.mark.parametrize("case", TEXTS, ids=range(len(TEXTS)))
def test_decode_matches_reference_and_round_trips(tokenizer, case):
    assert tokenizer.decode(case["ids"]) == case["decoded"]
    if case["roundtrip"]:
        assert tokenizer.decode(tokenizer.encode(case["text"])) == case["text"]


def test_divergence_from_transformers_gguf_loader_is_only_where_documented(tokenizer):
    """transformers' GGUF loader ignores pre-type `smollm`; we follow SmolLM2's own tokenizer."""
    diverging = [c["text"] for c in TEXTS if not c["transformers_gguf_agrees"]]
    assert any("a  12" in t for t in diverging) and any("½" in t for t in diverging)
    for case in TEXTS:
        assert (tokenizer.encode(case["text"]) == case["ids_transformers_gguf"]) == case["transformers_gguf_agrees"]


@pytest.mark.parametrize("case", CHATS, ids=range(len(CHATS)))
def test_chat_template_matches_reference(tokenizer, case):
    rendered = tokenizer.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert rendered == case["rendered"]
    assert tokenizer.encode(rendered) == case["ids"]


def test_chat_messages_may_be_objects_or_text_parts(tokenizer):
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}])
    as_object = [types.SimpleNamespace(role="user", content="hi there")]
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    assert tokenizer.apply_chat_template(as_object) == expected
    assert tokenizer.apply_chat_template(as_parts) == expected


@pytest.mark.parametrize(
    "messages, field",
    [
        ("hello", "messages"),
        ([], "messages"),
        ([{"content": "no role"}], r"messages\[0\].role"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"messages\[0\].content"),
        ([{"role": "user", "content": 42}], r"messages\[0\].content"),
    ],
)
def test_bad_messages_raise_value_error_naming_the_field(tokenizer, messages, field):
    with pytest.raises(ValueError, match=field):
        tokenizer.apply_chat_template(messages)


def test_special_tokens_are_single_ids(tokenizer):
    assert len(GOLDEN["special_tokens"]) == 17
    for text, token_id in GOLDEN["special_tokens"].items():
        assert tokenizer.encode(text) == [token_id]
        assert tokenizer.encode(f"a{text}b") == tokenizer.encode("a") + [token_id] + tokenizer.encode("b")
        assert tokenizer.is_special(token_id) and tokenizer.id_to_piece(token_id) == text


def test_bos_eos_and_stop_ids(tokenizer):
    specials = GOLDEN["special_tokens"]
    assert tokenizer.bos_token_id == GOLDEN["bos_token_id"] == specials["<|im_start|>"]
    assert tokenizer.eos_token_id == GOLDEN["eos_token_id"] == specials["<|im_end|>"]
    assert tokenizer.stop_token_ids == {specials["<|im_end|>"], specials["<|endoftext|>"]}
    assert not tokenizer.add_bos and tokenizer.encode("hi")[0] != tokenizer.bos_token_id
    assert tokenizer.vocab_size == 49152


def test_skip_special_tokens_on_decode(tokenizer):
    ids = tokenizer.encode("<|im_start|>assistant\nHi!<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "assistant\nHi!"


def test_pieces_are_the_exact_token_bytes(tokenizer):
    text = "naïve 😀 日本 x"
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.id_to_bytes(i) for i in ids) == text.encode("utf-8")
    pieces = [tokenizer.id_to_piece(i) for i in ids]
    assert any(p.startswith("bytes:\\x") for p in pieces)  # the emoji is split mid-character
    for token_id, piece in zip(ids, pieces, strict=True):
        if not piece.startswith("bytes:"):
            assert piece == tokenizer.decode([token_id])
    with pytest.raises(ValueError, match="token_id"):
        tokenizer.id_to_piece(tokenizer.vocab_size)
    with pytest.raises(ValueError, match="token_ids"):
        tokenizer.decode([0, -1])


# -- tiny synthetic GGUFs ----------------------------------------------------------------------

BYTE_CHARS = sorted(_byte_decoder(), key=_byte_decoder().get)  # 256 byte-level chars, byte order
TINY_SPECIALS = ["<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ Ġ", "Ġ 1", "h i"]
TINY_TOKENS = TINY_SPECIALS + BYTE_CHARS + ["ĠĠ", "Ġ1", "hi", "hid"]  # no merge makes "hid"


def _write_tiny_gguf(path: pathlib.Path, *, model="gpt2", pre="gpt2", template=None, add_bos=None) -> pathlib.Path:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_types([3, 3] + [1] * (len(TINY_TOKENS) - 2))
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    if template is not None:
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [TINY_TOKENS[i] for i in tokenizer.encode(text)]


@pytest.mark.parametrize(
    "pre, expected",
    [
        # SmolLM2: digits split off first, so the two spaces stay one run and merge.
        ("smollm", ["a", "ĠĠ", "1", "2"]),
        # GPT-2 regex: `\s+(?!\S)` leaves the last space to ` ?\p{N}+`, giving " 12".
        ("gpt2", ["a", "Ġ", "Ġ1", "2"]),
        # Llama 3 regex: numbers never take a leading space.
        ("llama-bpe", ["a", "Ġ", "Ġ", "1", "2"]),
        # llama.cpp default: GPT-2 split, then \p{N}+ cuts " 12" into " " and "12".
        ("default", ["a", "Ġ", "Ġ", "1", "2"]),
    ],
)
def test_pre_tokenizer_follows_gguf_pre_type(tmp_path, pre, expected):
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre))
    assert _pieces(tokenizer, "a  12") == expected
    assert _pieces(tokenizer, "hi<|im_end|>") == ["hi", "<|im_end|>"]


def test_gpt4o_pre_tokenizer_splits_as_its_regex_reads(tmp_path):
    """`gpt-4o` (Phi-4-mini's files): capitals start a word (a run of them joins the lower-case letters after it), a contraction stays on its word, numbers go in
    threes without a leading space, a punctuation mark leads the letters after it. Expected pieces worked
    out by hand from the o200k pattern's alternatives, in order."""
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "tiny.gguf", pre="gpt-4o"))
    split = tokenizer._backend.pre_tokenizer.pre_tokenize_str
    pieces = [p for p, _ in split("camelCase HTTPServer World's 12345 x\n\nfoo/bar")]
    assert [bytes(_byte_decoder()[c] for c in p).decode() for p in pieces] == [
        "camel", "Case", " HTTPServer", " World's", " ", "123", "45", " x", "\n\n", "foo", "/bar"]


@pytest.mark.parametrize("pre, whole", [("llama-bpe", True), ("tekken", True), ("gpt2", False), ("qwen2", False)])
def test_a_word_in_the_vocabulary_is_one_token_where_llama_cpp_ignores_merges(tmp_path, pre, whole):
    """Llama 3's family and tekken take a pre-token found whole in the vocabulary as one token (their
    tokenizer.json's ignore_merges; llama.cpp's too); the others build it from the merges alone."""
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre))
    assert _pieces(tokenizer, "hid") == (["hid"] if whole else ["hi", "d"])


def test_tekken_pre_tokenizer_splits_as_its_regex_reads(tmp_path):
    """tekken (Mistral Nemo and later): GPT-4o's words without its contractions, every digit alone."""
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "tiny.gguf", pre="tekken"))
    pieces = [p for p, _ in tokenizer._backend.pre_tokenizer.pre_tokenize_str("camelCase 123 don't\n")]
    assert [bytes(_byte_decoder()[c] for c in p).decode() for p in pieces] == [
        "camel", "Case", " ", "1", "2", "3", " don", "'t", "\n"]


def test_missing_template_falls_back_to_chatml(tmp_path):
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert tokenizer.chat_template is None
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False).endswith("hi<|im_end|>\n")


def test_template_helpers_and_errors(tmp_path):
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}"
        "{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"
    )
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "tiny.gguf", template=template))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "é\n"}]) == '<|im_start|>"é\\n"<|im_end|>'
    with pytest.raises(ValueError, match="messages: .*first message must be from the user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_chat_template_kwargs_reach_the_template_and_may_not_replace_its_own(tmp_path):
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking, for one) are variables the template sees."""
    from engine.core.request_input import prompt_token_ids
    from engine.errors import InvalidRequest
    from engine.serving.protocol import ChatMessage, Generate, SamplingParams

    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %}<|im_end|>{% endif %}")
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "tiny.gguf", template=template))

    def ids(kwargs_json):
        msg = Generate("r", SamplingParams(), messages=[ChatMessage("user", "hi")], chat_template_kwargs_json=kwargs_json)
        return prompt_token_ids(msg, tokenizer)

    assert _pieces(tokenizer, "hi") == ["hi"]
    assert ids(None) == ids('{"enable_thinking": true}') == tokenizer.encode("hi")
    assert ids('{"enable_thinking": false}') == tokenizer.encode("hi<|im_end|>") != ids(None)
    for bad in ('{"messages": []}', '{"bos_token": "x"}', "[1]"):
        with pytest.raises(InvalidRequest) as err:
            ids(bad)
        assert err.value.param == "chat_template_kwargs"


def test_unsupported_gguf_tokenizers_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.ggml.pre: unsupported pre-tokenizer 'mystery'"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "a.gguf", pre="mystery"))
    with pytest.raises(ValueError, match="tokenizer.ggml.model: .*'bert'"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "b.gguf", model="bert"))
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):  # SentencePiece, but no scores
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "d.gguf", model="llama"))
    with pytest.raises(ValueError, match="text"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "c.gguf")).encode(b"bytes")


def test_continue_final_message_ends_the_prompt_inside_the_final_message(tmp_path):
    """vLLM's continue_final_message: the rendering of the closed conversation, cut right after the final message's
    text. The references are the closed renderings with their end of turn taken off by hand: ChatML keeps a
    message as written (its trailing space too), the Gemma template trims it."""
    chatml = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "chatml.gguf"))
    chat = [{"role": "user", "content": "Say is"}, {"role": "assistant", "content": "It is "}]
    closed = chatml.apply_chat_template(chat, add_generation_prompt=False)
    assert closed.endswith("It is <|im_end|>\n")
    assert chatml.apply_chat_template(chat, False, True) == closed[: -len("<|im_end|>\n")]
    # the final text also appears earlier in the conversation: the last occurrence is the final message
    echo = [{"role": "user", "content": "It is"}, {"role": "assistant", "content": "It is"}]
    assert chatml.apply_chat_template(echo, False, True) == \
        chatml.apply_chat_template(echo, add_generation_prompt=False)[: -len("<|im_end|>\n")]

    from engine.model.chat_templates import GEMMA_TEMPLATE

    gemma = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "gemma.gguf", template=GEMMA_TEMPLATE))
    closed = gemma.apply_chat_template(chat, add_generation_prompt=False)
    assert closed.endswith("<start_of_turn>model\nIt is<end_of_turn>\n")
    assert gemma.apply_chat_template(chat, False, True) == closed[: -len("<end_of_turn>\n")]

    for final in ("", "  \n"):  # nothing to continue
        with pytest.raises(ValueError, match="messages: continue_final_message"):
            chatml.apply_chat_template([chat[0], {"role": "assistant", "content": final}], False, True)


def test_a_conversation_the_template_refuses_is_an_invalid_request_naming_messages(tmp_path):
    """A template's raise_exception (Gemma's turns that do not alternate, say) is the client's error: a 400
    naming `messages` through the worker, not an engine failure."""
    from engine.core.request_input import prompt_token_ids
    from engine.errors import InvalidRequest
    from engine.model.chat_templates import GEMMA_TEMPLATE
    from engine.serving.protocol import ChatMessage, Generate, SamplingParams

    gemma = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "gemma.gguf", template=GEMMA_TEMPLATE))
    twice = [ChatMessage("user", "one"), ChatMessage("user", "two")]
    with pytest.raises(InvalidRequest, match="alternate user and assistant turns") as err:
        prompt_token_ids(Generate("r", SamplingParams(), messages=twice), gemma)
    assert err.value.param == "messages"
    empty = [ChatMessage("user", "one"), ChatMessage("assistant", "")]
    with pytest.raises(InvalidRequest, match="continue_final_message") as err:
        prompt_token_ids(Generate("r", SamplingParams(), messages=empty, add_generation_prompt=False,
                                  continue_final_message=True), gemma)
    assert err.value.param == "messages"


def test_add_special_tokens_false_adds_no_bos(tmp_path):
    """vLLM's add_special_tokens: a model whose file asks for a BOS gets one before a text prompt, unless the
    request says false (Generate and /tokenize alike); token-id prompts are kept as sent."""
    from engine.core.request_input import prompt_token_ids, tokens_reply
    from engine.serving.protocol import Generate, SamplingParams, Tokenize

    tok = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "bos.gguf", add_bos=True))
    hi = TINY_TOKENS.index("hi")
    assert prompt_token_ids(Generate("a", SamplingParams(), prompt="hi"), tok) == [0, hi]
    assert prompt_token_ids(Generate("b", SamplingParams(), prompt="hi", add_special_tokens=False), tok) == [hi]
    assert tokens_reply(Tokenize("c", prompt="hi", add_special_tokens=False), tok).token_ids == [hi]
    kept = Generate("d", SamplingParams(), prompt_token_ids=[hi], add_special_tokens=True)
    assert prompt_token_ids(kept, tok) == [hi]
