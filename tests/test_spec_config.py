"""engine.spec_decode.spec_config: parsing, defaults and a ValueError naming the field for each bad input."""

import dataclasses
from importlib.metadata import EntryPoint

import pytest

from engine.spec_decode.spec_config import SpeculativeConfig, parse_speculative_config
from proposers.naive import NaiveProposer
from proposers.ngram import NgramProposer
from proposers.registry import GROUP, ProposerRegistry
from proposers.suffix import SuffixProposer


@pytest.fixture
def registry():
    eps = [EntryPoint("naive", "proposers.naive:NaiveProposer", GROUP),
           EntryPoint("ngram", "proposers.ngram:NgramProposer", GROUP),
           EntryPoint("suffix", "proposers.suffix:SuffixProposer", GROUP)]
    return ProposerRegistry(eps, use_env=False)


def parse(value, registry):
    return parse_speculative_config(value, registry=registry)


def test_empty_values_mean_no_speculation(registry):
    assert parse(None, registry) is None
    assert parse("  ", registry) is None


def test_flat_json_with_vllm_option_names(registry):
    config = parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, '
                   '"verify_strategy": "target_match", "max_draft_tokens_per_step": 0}', registry)
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                       verify_strategy="target_match", max_draft_tokens_per_step=0,
                                       options={"max_ngram_size": 3, "min_ngram_size": 2})


def test_defaults_come_from_the_proposer_class(registry):
    for method, cls in [("naive", NaiveProposer), ("ngram", NgramProposer), ("suffix", SuffixProposer)]:
        config = parse({"method": method}, registry)
        assert config.num_speculative_tokens == cls.default_num_speculative_tokens
        assert config.options == cls.options_dict({})
        assert config.accept_policy == "normal" and config.max_draft_tokens_per_step == 128
    assert parse({"method": "naive"}, registry).num_speculative_tokens == 0


def test_nested_options_object_is_accepted(registry):
    config = parse({"method": "suffix", "options": {"suffix_decoding_max_tree_depth": 24}}, registry)
    assert config.options["suffix_decoding_max_tree_depth"] == 24


def test_auto_strategy_is_greedy_at_zero_then_target_match_for_one_hot_drafts_and_rejection_with_q(registry):
    config = parse({"method": "ngram"}, registry)
    assert config.strategy_for(0.0) == "greedy" and config.strategy_for(0.0, has_draft_probs=True) == "greedy"
    assert config.strategy_for(0.7) == "target_match" and config.strategy_for(0.7, has_draft_probs=True) == "rejection"
    assert parse({"method": "ngram", "verify_strategy": "rejection"}, registry).strategy_for(0.7) == "rejection"
    assert parse({"method": "ngram", "verify_strategy": "topp"}, registry).strategy_for(0.0) == "topp"


def test_config_is_frozen(registry):
    config = parse({"method": "ngram"}, registry)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.method = "suffix"


@pytest.mark.parametrize("value,field", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"num_speculative_tokens": 3}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "verify_strategy": "typical"}, "verify_strategy"),
    ({"method": "ngram", "accept_policy": "sometimes"}, "accept_policy"),
    ({"method": "ngram", "max_draft_tokens_per_step": -5}, "max_draft_tokens_per_step"),
    ({"method": "ngram", "max_candidate_len": 0}, "max_candidate_len"),
    ({"method": "ngram", "verify_top_p": 1.5}, "verify_top_p"),
    ({"method": "ngram", "lookahead": 3}, "lookahead"),
    ({"method": "ngram", "max_ngram_size": 0}, "max_ngram_size"),
    ({"method": "ngram", "max_ngram_size": "5"}, "max_ngram_size"),
    ({"method": "ngram", "min_ngram_size": 4, "max_ngram_size": 3}, "min_ngram_size"),
    ({"method": "ngram", "prompt_lookup_max": 3, "max_ngram_size": 3}, "max_ngram_size"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 2}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "suffix_decoding_max_tree_depth"),
    ({"method": "naive", "max_ngram_size": 3}, "max_ngram_size"),
    ({"method": "ngram", "options": [1]}, "options"),
    ({"method": "ngram", "max_ngram_size": 3, "options": {"max_ngram_size": 4}}, "max_ngram_size"),
])
def test_bad_input_is_a_value_error_naming_the_field(registry, value, field):
    with pytest.raises(ValueError, match=field):
        parse(value, registry)


def test_unknown_method_lists_the_installed_ones(registry):
    with pytest.raises(ValueError, match=r"method: unknown proposer 'eagle'; installed: naive, ngram, suffix"):
        parse({"method": "eagle"}, registry)


def test_default_registry_knows_the_builtins():
    """Without an explicit registry: installed entry points, or pyproject.toml in a checkout."""
    assert parse_speculative_config('{"method": "suffix"}').method == "suffix"
