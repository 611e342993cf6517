"""Model-based proposers (draft_model, eagle, mtp, medusa) on the real model: greedy output identical to
non-speculative output alone and concurrently, clear config errors, per-request method choice, and the
hidden states a head sees equal an independent forward's."""

from __future__ import annotations

import contextlib
import json

import gguf
import numpy as np
import pytest

from engine.model.cpu_runner import CacheConfig, CpuRunner, ForwardBatch
from engine.errors import InvalidRequest
from engine.generate import generate
from engine.model.gguf_loader import GGUFModel
from engine.serving.protocol import ChatMessage, Generate, SamplingParams
from random_heads import write_random_head
from test_spec_control import CPU_CURVE, HEAD_COST
from tiny_models import copy_tokenizer

PROMPTS = [
    [ChatMessage("user", "What is the boiling point of water?")],
    "Alice met Bob. Alice said hello to Bob. Bob said hello to Alice. Alice met Bob. Alice said",
    [ChatMessage("user", "Write a haiku about the sea.")],
    "Hello",  # one token: it asks for drafts in its first step, before the target has given any feature
]
GREEDY = SamplingParams(max_tokens=32, temperature=0.0)


def write_first_layers(src, dst, num_layers: int):
    """A real draft GGUF: the source's first layers, final norm and head, tensors copied as they are."""
    model = GGUFModel(src)
    cfg = model.config
    writer = gguf.GGUFWriter(str(dst), "llama")
    copy_tokenizer(writer, model.metadata)
    writer.add_name(f"{cfg.name} first {num_layers} layers")
    for add, value in ((writer.add_block_count, num_layers), (writer.add_embedding_length, cfg.hidden_size),
                       (writer.add_feed_forward_length, cfg.intermediate_size), (writer.add_head_count, cfg.num_heads),
                       (writer.add_head_count_kv, cfg.num_kv_heads), (writer.add_rope_freq_base, cfg.rope_theta),
                       (writer.add_layer_norm_rms_eps, cfg.rms_eps), (writer.add_context_length, cfg.context_length),
                       (writer.add_vocab_size, cfg.vocab_size)):
        add(value)
    for t in model.tensors.values():
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= num_layers:
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


@pytest.fixture(scope="module")
def heads(tmp_path_factory, model_path):
    cfg = GGUFModel(model_path).config
    d = tmp_path_factory.mktemp("heads")
    return {kind: str(write_random_head(d / kind, kind, cfg, num_modules=n, seed=i))
            for i, (kind, n) in enumerate((("eagle", 1), ("mtp", 2), ("medusa", 3)))}


@pytest.fixture(scope="module")
def reference(engine):
    return [generate(engine, [p], GREEDY)[0].token_ids for p in PROMPTS]


def spec_configs(heads, draft_file):
    return {
        "draft_model_layers": {"method": "draft_model", "num_speculative_tokens": 3, "draft_layers": 30},
        "draft_model_file": {"method": "draft_model", "num_speculative_tokens": 2, "model": str(draft_file)},
        "eagle": {"method": "eagle", "num_speculative_tokens": 3, "model": heads["eagle"]},
        "eagle_q4_0": {"method": "eagle", "num_speculative_tokens": 3, "model": heads["eagle"], "weights": "q4_0"},
        "mtp_with_ngram": {"method": "mtp", "num_speculative_tokens": 4, "num_model_steps": 2,
                           "mtp_strategy": "with_ngram", "model": heads["mtp"]},
        "mtp_ngram_first": {"method": "mtp", "num_speculative_tokens": 4, "num_model_steps": 2,
                            "mtp_strategy": "ngram_first", "model": heads["mtp"]},
        "medusa": {"method": "medusa", "num_speculative_tokens": 3, "model": heads["medusa"]},
    }


@pytest.fixture(scope="module")
def spec_engine(heads, make_engine, model_path, tmp_path_factory):
    """Engines by config name, built once per module (each is a model load)."""
    built = {}

    def get(name):
        if name not in built:
            draft_file = None
            if name == "draft_model_file":
                draft_file = write_first_layers(model_path, tmp_path_factory.mktemp("draft") / "draft.gguf", 6)
            built[name] = make_engine(speculative_config=json.dumps(spec_configs(heads, draft_file)[name]))
        return built[name]

    return get


@pytest.mark.parametrize("name", ["draft_model_layers", "draft_model_file", "eagle", "eagle_q4_0", "mtp_with_ngram",
                                  "mtp_ngram_first", "medusa"])
def test_greedy_identical_alone_and_concurrent(name, spec_engine, reference):
    engine = spec_engine(name)
    alone = [generate(engine, [p], GREEDY)[0] for p in PROMPTS]
    assert [g.token_ids for g in alone] == reference
    assert sum(g.num_draft_tokens for g in alone) > 0, "never drafted: the test proves nothing"
    together = generate(engine, PROMPTS + PROMPTS[:1], GREEDY)
    assert [g.token_ids for g in together] == reference + reference[:1]
    if name == "draft_model_layers":  # the draft IS the target: every draft must pass
        assert sum(g.num_accepted_tokens for g in alone) == sum(g.num_draft_tokens for g in alone)


def test_head_sees_the_targets_final_normed_hidden_states(spec_engine, model_path):
    engine = spec_engine("eagle")
    seen: dict[int, np.ndarray] = {}
    proposer = engine.proposer
    original = proposer.observe_hidden

    def record(request_id, start, hidden):
        for j, row in enumerate(hidden):
            seen[start + j] = row.copy()
        original(request_id, start, hidden)

    proposer.observe_hidden = record
    prompt = engine.tokenizer.encode("A prompt no other test sends (so no prefix-cache hit): the moon and the tides")
    try:
        out = generate(engine, [prompt], SamplingParams(max_tokens=20, temperature=0.0))[0]
    finally:
        del proposer.observe_hidden
    tokens = np.asarray(prompt + out.token_ids[:-1], np.int32)
    assert sorted(seen) == list(range(len(tokens))), "every computed position is observed exactly once"
    model = GGUFModel(model_path)
    cache = CacheConfig(16, 8, 128, 1, 128)
    runner = CpuRunner(model, cache)
    runner.capture_hidden = True
    fb = ForwardBatch(cache)
    fb.add(tokens, 0, list(range(8)), 1)
    runner.forward(fb)
    expected = runner.hidden_states(len(tokens))
    np.testing.assert_array_equal(np.stack([seen[p] for p in range(len(tokens))]), expected)


@pytest.mark.parametrize("config, field", [
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"method": "draft_model", "draft_layers": 0}, "speculative_config.draft_layers"),
    ({"method": "mtp", "num_speculative_tokens": 2, "num_model_steps": 3}, "speculative_config.num_model_steps"),
    ({"method": "mtp", "mtp_strategy": "ngram_only"}, "speculative_config.mtp_strategy"),
    ({"method": "eagle", "weights": "int3"}, "speculative_config.weights"),
    ({"method": "eagle", "attention_window": -1}, "speculative_config.attention_window"),
    ({"method": "mtp", "attention_window": "all"}, "speculative_config.attention_window"),
    ({"method": "medusa", "heads": 4}, "speculative_config.heads"),
])
def test_bad_config_is_a_value_error_naming_the_field(config, field):
    from engine.engine_setup import build_engine_parts
    from conftest import engine_args

    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        build_engine_parts(engine_args(speculative_config=json.dumps(config)))


def test_head_for_another_model_and_other_vocabulary_are_refused(heads, tmp_path, model_path, monkeypatch):
    """Refused before the target's weights are packed (`check_target`): a bad config fails in a second."""
    from engine import engine_setup
    from engine.engine_setup import build_engine_parts
    from conftest import engine_args
    from tiny_models import write_tiny_llama

    def no_runner(*args):
        raise AssertionError("the target's runner was built before the proposer's config was checked")

    monkeypatch.setattr(engine_setup, "make_runner", no_runner)
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", model_path)
    bad_head = write_random_head(tmp_path / "wrong", "eagle", GGUFModel(tiny).config)
    with pytest.raises(ValueError, match=r"speculative_config\.model: head .* hidden_size=64"):
        build_engine_parts(engine_args(speculative_config=json.dumps({"method": "eagle", "model": str(bad_head)})))
    with pytest.raises(ValueError, match=r"speculative_config\.model: no eagle head ships for"):
        build_engine_parts(engine_args(model=str(tiny), speculative_config=json.dumps({"method": "eagle"})))
    other = write_tiny_llama(tmp_path / "other_vocab.gguf", model_path, rename={7: "zzz-not-a-token"})
    config = {"method": "draft_model", "model": str(other)}
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's token 7 is 'zzz-not-a-token'"):
        build_engine_parts(engine_args(model=str(tiny), speculative_config=json.dumps(config)))


def test_request_picks_another_method_and_unknown_methods_are_400s(spec_engine, engine, reference):
    spec = spec_engine("medusa")
    params = SamplingParams(max_tokens=32, temperature=0.0, speculative_method="suffix")
    got = generate(spec, [PROMPTS[1]], params)[0]
    assert got.token_ids == reference[1]
    assert "suffix" in spec.proposers.by_method
    for target, method in ((spec, "no-such-method"), (engine, "suffix")):
        bad = Generate("bad-1", SamplingParams(max_tokens=4, speculative_method=method), prompt="hi")
        with pytest.raises(InvalidRequest) as err:
            target.add_request(bad)
        assert err.value.param == "speculative.method"
        assert not target.has_unfinished()


@contextlib.contextmanager
def fixed_costs(controller):
    """The controller with a fixed cost model (a verify curve and draft cost measured once on the 2-core CPU)
    and no learned rates, instead of the start-up timings of whatever machine runs the test: which source
    drafts at each step depends on them, and the test must make the same choices everywhere."""
    saved = controller.verify_cost, controller.t1_seconds, controller.draft_cost, controller.prior
    controller.verify_cost = CPU_CURVE.copy()  # [max_k + 2], in plain steps
    controller.t1_seconds, controller.draft_cost, controller.prior = 0.0, {"mtp": HEAD_COST}, {}  # t1 0: no timing
    try:
        yield
    finally:
        controller.verify_cost, controller.t1_seconds, controller.draft_cost, controller.prior = saved


@pytest.mark.parametrize("name", ["mtp_ngram_first", "mtp_with_ngram"])
def test_hybrids_draft_from_each_source_and_the_engine_judges_them_apart(name, spec_engine, reference):
    """Both sources draft in one request (ngram_first: the lookup where the text repeats; with_ngram: the
    modules first, until their misses take their cap to 0 and the lookup drafts alone); each source gets
    its own record."""
    engine = spec_engine(name)
    assert engine.proposer.draft_sources == ("ngram", "mtp")
    with fixed_costs(engine.controller):
        for prompt in PROMPTS:  # the server-wide rates new requests start from: learned on these first
            generate(engine, [prompt], GREEDY)
        engine.add_request(Generate(f"sources-{name}", GREEDY, prompt=PROMPTS[1]))
        seq, drafted_by, tokens = engine.seqs[f"sources-{name}"], [], []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.token_ids
            drafted_by.append(engine.draft_source.get(f"sources-{name}"))
    assert tokens == reference[1]
    assert set(seq.draft_stats) == {"ngram", "mtp"}
    assert {"ngram", "mtp"} <= set(drafted_by)  # both sources drafted in this request
    ngram, head = seq.draft_stats["ngram"], seq.draft_stats["mtp"]
    # the random head's guesses fail, the lookup's copies of the prompt pass: told apart
    assert head.first < 0.5 < ngram.first
