"""OpenAI's presence / frequency penalties and logit_bias (engine/core/penalties.py), against references
written here from OpenAI's definition: logits[t] -= frequency * c[t] + presence * (c[t] > 0), c[t] the count of t
among the generated tokens, then logits[t] += logit_bias[t]."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from engine.core.penalties import LogitBias, apply_penalties
from engine.generate import generate
from engine.serving.protocol import Generate, SamplingParams

F32 = np.float32


def openai_penalized(logits: np.ndarray, generated: list[int], params: SamplingParams) -> np.ndarray:
    """One row processed token by token, as OpenAI's documentation writes it (float32 throughout)."""
    out = logits.copy()
    for token, count in Counter(generated).items():
        out[token] = out[token] - (F32(params.frequency_penalty) * F32(count) + F32(params.presence_penalty))
    for token, bias in params.logit_bias.items():
        out[token] = out[token] + F32(bias)
    return out


def test_each_verify_row_counts_the_drafts_before_it():
    """Row j of a verify run follows the generated tokens and drafts 0..j-1; the prompt's tokens never count."""
    rng = np.random.default_rng(0)
    params = SamplingParams(frequency_penalty=0.7, presence_penalty=-0.3, logit_bias={3: 5.0, 11: -100.0})
    prompt, generated, drafts = [3, 3, 4], [5, 6, 5, 9], np.array([5, 3, 7], np.int32)
    seq = SimpleNamespace(request_id="r", params=params, num_prompt_tokens=len(prompt),
                          num_tokens=len(prompt) + len(generated), token_ids=np.array(prompt + generated + [0] * 8))
    logits = rng.standard_normal((6, 16)).astype(np.float32)  # [rows, vocab]: rows 1..4 are this request's
    want = logits.copy()
    for j in range(1 + len(drafts)):
        want[1 + j] = openai_penalized(logits[1 + j], generated + drafts[:j].tolist(), params)
    apply_penalties(logits, [(seq, 1, drafts)], {"r": LogitBias(params.logit_bias)})
    np.testing.assert_array_equal(logits, want)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_path):
    from tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("penalties") / "tiny.gguf", model_path, seed=3)


def reference_greedy(path, prompt: list[int], params: SamplingParams) -> list[int]:
    """Greedy decoding with the penalties applied here, each step a fresh forward over the whole sequence."""
    from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
    from engine.model.gguf_loader import GGUFModel

    cache = CacheConfig(block_size=16, num_blocks=8, max_model_len=128, max_num_seqs=1, max_num_batched_tokens=128)
    runner = CpuRunner(GGUFModel(path), cache, num_threads=2, numerics="int8")
    batch, ids = ForwardBatch(runner.cache), list(prompt)
    for _ in range(params.max_tokens):
        batch.clear()
        batch.add(np.array(ids, np.int32), 0, list(range(8)), 1)
        logits = runner.forward(batch)[0]  # [vocab]
        ids.append(int(np.argmax(openai_penalized(logits, ids[len(prompt):], params))))
    return ids[len(prompt):]


GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PUSH = {17: 30.0}  # lifts token 17 (~10 against a top logit of ~33) above the rest, so the penalties have work
CASES = {  # name: (params, the same without what is tested)
    "frequency": ({"logit_bias": PUSH, "frequency_penalty": 1.5}, {"logit_bias": PUSH}),
    "presence": ({"logit_bias": PUSH, "presence_penalty": 2.0, "frequency_penalty": 1.0},
                 {"logit_bias": PUSH, "frequency_penalty": 1.0}),
    "logit_bias": ({"logit_bias": {17: 30.0, 300: -100.0}}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_greedy_decoding_follows_the_reference(tiny, case):
    """The engine (a random tiny model, one token a step) emits what the step-by-step reference picks, and that
    differs from what it emits without the penalty (or bias) under test."""
    import msgspec
    from conftest import engine_args

    from engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(engine_args(model=str(tiny), max_model_len=128))
    prompt = [5, 80, 81, 82, 5, 80, 81]
    params, without = (msgspec.structs.replace(GREEDY, **fields) for fields in CASES[case])
    got = generate(engine, [prompt], params)[0].token_ids
    assert got == reference_greedy(tiny, prompt, params)
    assert got != generate(engine, [prompt], without)[0].token_ids


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused(engine):
    from engine.errors import InvalidRequest

    vocab = engine.tokenizer.vocab_size
    for bias, message in (({vocab: 1.0}, "vocabulary"), ({5: 101.0}, "between -100 and 100")):
        with pytest.raises(InvalidRequest, match=message) as err:
            engine.add_request(Generate("bad-bias", SamplingParams(logit_bias=bias), prompt="hi"))
        assert err.value.param == "logit_bias"
    with pytest.raises(InvalidRequest, match="between -2 and 2"):
        engine.add_request(Generate("bad-penalty", SamplingParams(presence_penalty=2.5), prompt="hi"))
    assert "bad-bias" not in engine.request_ids() and not engine.penalized
