"""Penalties, logit_bias, min_p, min_tokens and allowed_token_ids (engine/core/logits_processing.py), against
references written here from the parameters' definitions: allowed_token_ids (vLLM): every other token removed;
min_tokens n (vLLM): the stop tokens removed at output positions below n; repetition_penalty r (vLLM): a seen
token's logit / r if positive, else * r; OpenAI's logit -= frequency * c + presence * (c > 0), c its count among
the generated tokens, then += logit_bias; min_p m at temperature T: a token below max + T * log(m) is removed."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest

from engine.core.logits_processing import RequestArrays, process_rows
from engine.generate import generate
from engine.serving.protocol import Generate, SamplingParams

F32 = np.float32


def processed(logits: np.ndarray, prompt: list[int], generated: list[int], p: SamplingParams,
              stops: tuple = (), bad: tuple = ()) -> np.ndarray:
    """One row processed token by token, each parameter as its documentation writes it (float32 throughout);
    stops: the stop tokens min_tokens holds back (the caller's EOS and stop_token_ids); bad: the bad words'
    token runs (a run's last token is removed where the text before the row ends with the rest)."""
    out = logits.copy()
    if p.allowed_token_ids:
        out[[t for t in range(len(out)) if t not in p.allowed_token_ids]] = -np.inf
    if len(generated) < p.min_tokens:
        out[list(stops)] = -np.inf
    text = prompt + generated
    for run in bad:
        if len(run) == 1 or (len(text) >= len(run) - 1 and text[len(text) - len(run) + 1:] == list(run[:-1])):
            out[run[-1]] = -np.inf
    for token in set(prompt) | set(generated):
        if p.repetition_penalty != 1.0:
            r = F32(p.repetition_penalty)
            out[token] = out[token] / r if out[token] > 0 else out[token] * r
    for token, count in Counter(generated).items():
        out[token] = out[token] - (F32(p.frequency_penalty) * F32(count) + F32(p.presence_penalty))
    for token, bias in p.logit_bias.items():
        out[token] = out[token] + F32(bias)
    if p.min_p and p.temperature > 0:
        cut = out.max() + F32(p.temperature * np.log(p.min_p))
        out[[t for t in range(len(out)) if out[t] < cut]] = -np.inf
    return out


def test_each_verify_row_counts_the_drafts_before_it():
    """Row j of a verify run follows the request's tokens and drafts 0..j-1; the frequency and presence
    penalties skip the prompt's tokens, the repetition penalty does not."""
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.7, frequency_penalty=0.7, presence_penalty=-0.3, repetition_penalty=1.3,
                            min_p=0.05, logit_bias={3: 5.0, 11: -100.0}, min_tokens=6, stop_token_ids=[2],
                            allowed_token_ids=[t for t in range(16) if t != 9])
    prompt, generated, drafts = [3, 3, 4, 12], [5, 6, 5, 9], np.array([5, 3, 7], np.int32)
    seq = SimpleNamespace(request_id="r", params=params, num_prompt_tokens=len(prompt), num_output_tokens=4,
                          num_tokens=len(prompt) + len(generated), token_ids=np.array(prompt + generated + [0] * 8))
    logits = (3 * rng.standard_normal((6, 16))).astype(np.float32)  # [rows, vocab]: rows 1..4 are this request's
    want = logits.copy()
    for j in range(1 + len(drafts)):
        want[1 + j] = processed(logits[1 + j], prompt, generated + drafts[:j].tolist(), params, stops=(2, 0))
    process_rows(logits, [(seq, 1, drafts)], {"r": RequestArrays(params, [0], 16)})  # EOS: token 0
    np.testing.assert_array_equal(logits, want)
    assert np.isinf(want[1:5]).any() and not np.isinf(want[1:5]).all(1).any()  # min_p removed some, never all
    assert np.isinf(want[1:5, 9]).all() and np.isinf(want[1:3, [0, 2]]).all()  # not allowed; held back at 4, 5


def test_min_tokens_lets_a_row_stop_when_nothing_else_is_allowed():
    params = SamplingParams(temperature=0.0, min_tokens=5, allowed_token_ids=[0, 4])
    seq = SimpleNamespace(request_id="r", params=params, num_prompt_tokens=1, num_output_tokens=0, num_tokens=1,
                          token_ids=np.zeros(8, np.int32))
    logits = np.arange(16, dtype=np.float32)[None].repeat(2, 0)  # [rows, vocab]
    process_rows(logits, [(seq, 0, np.array([4], np.int32))], {"r": RequestArrays(params, [0, 4], 16)})
    assert logits[0, 0] == 0.0 and logits[0, 4] == 4.0 and np.isinf(logits[0, 1:4]).all()  # both stop: kept


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    from tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("logits") / "tiny.gguf", model_path, seed=3)


@pytest.fixture(scope="module")
def raw_logits(tiny):
    """ids -> the logits after them, from a runner of our own: each call a fresh forward over the whole sequence
    (the engine's incremental steps give the same bits: the invariance tests)."""
    from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
    from engine.model.gguf_loader import GGUFModel

    cache = CacheConfig(block_size=16, num_blocks=8, max_model_len=128, max_num_seqs=1, max_num_batched_tokens=128)
    runner = CpuRunner(GGUFModel(tiny), cache, num_threads=2, numerics="int8")
    batch = ForwardBatch(runner.cache)

    def logits_after(ids: list[int]) -> np.ndarray:
        batch.clear()
        batch.add(np.array(ids, np.int32), 0, list(range(8)), 1)
        return runner.forward(batch)[0].copy()  # [vocab]

    return logits_after


@pytest.fixture(scope="module")
def tiny_engine(tiny):
    from conftest import engine_args

    from engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args(model=str(tiny), max_model_len=128))


PROMPT = [5, 80, 81, 82, 5, 80, 81]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PUSH = {17: 30.0}  # lifts token 17 (~10 against a top logit of ~33) above the rest, so the penalties have work
CASES = {  # name: (params, the same without what is tested)
    "frequency": ({"logit_bias": PUSH, "frequency_penalty": 1.5}, {"logit_bias": PUSH}),
    "presence": ({"logit_bias": PUSH, "presence_penalty": 2.0, "frequency_penalty": 1.0},
                 {"logit_bias": PUSH, "frequency_penalty": 1.0}),
    "repetition": ({"logit_bias": {17: 24.0}, "repetition_penalty": 2.0}, {"logit_bias": {17: 24.0}}),
    "logit_bias": ({"logit_bias": {17: 30.0, 300: -100.0}}, {}),
    "allowed_token_ids": ({"allowed_token_ids": [5, 17, 80, 81, 82, 300, 301]}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_decoding_follows_the_reference(tiny_engine, raw_logits, case):
    """The engine (a random tiny model, one token a step) emits what greedy decoding over the reference's
    processed logits picks, and that differs from what it emits without the parameter under test."""
    params, without = (msgspec.structs.replace(GREEDY, **fields) for fields in CASES[case])
    got = generate(tiny_engine, [PROMPT], params)[0].token_ids
    ids = list(PROMPT)
    for _ in range(params.max_tokens):
        ids.append(int(np.argmax(processed(raw_logits(ids), PROMPT, ids[len(PROMPT):], params))))
    assert got == ids[len(PROMPT):]
    assert got != generate(tiny_engine, [PROMPT], without)[0].token_ids


def test_min_tokens_holds_a_stop_token_back_until_its_position(tiny_engine, raw_logits):
    """A stop token greedy decoding emits third is held back until output position 10, as the reference does
    (stop ids masked below min_tokens), then stops the request when greedy picks it again."""
    stop = generate(tiny_engine, [PROMPT], GREEDY)[0].token_ids[2]
    short = generate(tiny_engine, [PROMPT], msgspec.structs.replace(GREEDY, stop_token_ids=[stop]))[0]
    params = msgspec.structs.replace(GREEDY, stop_token_ids=[stop], min_tokens=10)
    got = generate(tiny_engine, [PROMPT], params)[0]
    ids = list(PROMPT)
    while len(ids) - len(PROMPT) < params.max_tokens and (len(ids) == len(PROMPT) or ids[-1] != stop):
        ids.append(int(np.argmax(processed(raw_logits(ids), PROMPT, ids[len(PROMPT):], params, stops=(stop,)))))
    assert got.token_ids == ids[len(PROMPT):] and len(short.token_ids) == 3 and len(got.token_ids) > 10
    assert stop not in got.token_ids[:10]


def test_bad_words_remove_a_words_last_token_where_the_rest_precedes_it():
    """Row-level: a word encoded as [3, 4] alone and [5, 4] after a space; 4 goes where 3 or 5 comes just
    before (the request's last token, or a draft), and a one-token word's token goes everywhere."""
    words = {"ab": [3, 4], " ab": [5, 4], "c": [9], " c": [9]}
    params = SamplingParams(temperature=0.0, bad_words=["ab", " c"])
    arrays = RequestArrays(params, [0], 16, encode=lambda text: words[text])
    assert arrays.bad == [((), 9), ((3,), 4), ((5,), 4)]
    seq = SimpleNamespace(request_id="r", params=params, num_prompt_tokens=2, num_output_tokens=1, num_tokens=3,
                          token_ids=np.array([1, 2, 3, 0, 0, 0, 0, 0]))
    logits = np.zeros((4, 16), np.float32)
    process_rows(logits, [(seq, 0, np.array([7, 5, 4], np.int32))], {"r": arrays})
    assert [bool(np.isinf(row[4])) for row in logits] == [True, False, True, False]  # after 3; 7; 5; 4
    assert np.isinf(logits[:, 9]).all() and np.isfinite(np.delete(logits, [4, 9], axis=1)).all()


def test_bad_words_in_greedy_decoding_follow_the_reference(tiny_engine, raw_logits, tokenizer):
    """A word greedy decoding emits (one run of its tokens) is never completed once it is banned, and the engine
    emits what greedy decoding over the reference's processed logits picks."""
    plain = generate(tiny_engine, [PROMPT], GREEDY)[0].token_ids
    word = tokenizer.decode(plain[2:4]).strip()
    params = msgspec.structs.replace(GREEDY, bad_words=[word])
    runs = {tuple(tokenizer.encode(text)) for text in (word, " " + word)}
    got = generate(tiny_engine, [PROMPT], params)[0].token_ids
    ids = list(PROMPT)
    for _ in range(params.max_tokens):
        ids.append(int(np.argmax(processed(raw_logits(ids), PROMPT, ids[len(PROMPT):], params, bad=tuple(runs)))))
    assert got == ids[len(PROMPT):] and got != plain
    for run in runs:
        assert not any(ids[i : i + len(run)] == list(run) for i in range(len(PROMPT) - len(run) + 1, len(ids)))


def test_sampled_tokens_keep_to_min_p_with_drafts(tiny, raw_logits, make_engine):
    """Sampling at temperature 1 with min_p, the target drafting for itself (draft_model: its drafts follow the
    unprocessed distribution, so some fall outside min_p and must be rejected): every emitted token keeps to min_p
    at its position, while without min_p some do not."""
    engine = make_engine(model=str(tiny), max_model_len=128, speculative_config=json.dumps(
        {"method": "draft_model", "model": str(tiny), "num_speculative_tokens": 3}))
    sampled = SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True, seed=7)

    def cut_margins(params: SamplingParams) -> list[float]:
        out = generate(engine, [PROMPT], params)[0]
        assert out.num_draft_tokens > 0 and out.num_accepted_tokens > 0
        ids, margins = list(PROMPT), []
        for token in out.token_ids:
            logits = raw_logits(ids)
            margins.append(float(logits[token] - (logits.max() + F32(np.log(0.3)))))
            ids.append(token)
        return margins

    assert min(cut_margins(msgspec.structs.replace(sampled, min_p=0.3))) >= 0
    assert min(cut_margins(sampled)) < 0


def test_out_of_range_values_are_refused_by_name(engine):
    from engine.errors import InvalidRequest

    vocab = engine.tokenizer.vocab_size
    for fields, param in (({"logit_bias": {vocab: 1.0}}, "logit_bias"), ({"logit_bias": {5: 101.0}}, "logit_bias"),
                          ({"presence_penalty": 2.5}, "presence_penalty"),
                          ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
                          ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"), ({"min_tokens": -1}, "min_tokens"),
                          ({"allowed_token_ids": [vocab]}, "allowed_token_ids"),
                          ({"allowed_token_ids": [5], "grammar": "{}"}, "allowed_token_ids"),
                          ({"bad_words": [" "]}, "bad_words")):
        with pytest.raises(InvalidRequest) as err:
            engine.add_request(Generate("bad", SamplingParams(**fields), prompt="hi"))
        assert err.value.param == param
    assert "bad" not in engine.request_ids() and not engine.row_arrays
