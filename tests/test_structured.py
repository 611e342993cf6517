"""Constrained decoding in the engine (real SmolLM2): llguidance masks at every verified row.

- greedy output under a JSON schema or a regex is identical with speculation (ngram, suffix,
  draft_layers, eagle) and without it (the per-request cap 0 turns off every draft, grammar-forced ones too);
- 100 random JSON schemas (nested objects, enums, bounded arrays, numbers with bounds in steps of 0.25): every output
  parses and validates against its schema (checked with `jsonschema`, not with the grammar library);
- where the grammar allows one continuation, its tokens are drafted for free and accepted.
The statistical check of sampling under a grammar is in test_rejection_with_draft_model.py.
"""

from __future__ import annotations

import json

import jsonschema
import llguidance
import numpy as np
import pytest

from engine.generate import generate
from engine.serving.protocol import ChatMessage, SamplingParams

# Every field bounded (as in random_schema): a greedy small model may write an unbounded integer's digits until
# max_tokens, and whether it does turns on near-ties that any change of the kernels' last bits can flip.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "items": {"enum": ["en", "fr", "de", "zh"]}, "maxItems": 3}}}
CASES = [
    ("Describe Ada Lovelace as JSON.", llguidance.LLMatcher.grammar_from_json_schema(PERSON)),
    ("Give three fruits as JSON.", llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3})),
    ("What is today's date? Answer as YYYY-MM-DD.", llguidance.LLMatcher.grammar_from_regex(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
    ("Repeat: red, green, blue, red, green, blue, red,", llguidance.LLMatcher.grammar_from_regex(r"( (red|green|blue),){4,8}")),
]
METHODS = [{"method": "ngram", "num_speculative_tokens": 5, "max_ngram_size": 3, "min_ngram_size": 1},
           {"method": "suffix", "num_speculative_tokens": 6},
           {"method": "draft_model", "draft_layers": 10, "num_speculative_tokens": 3}]


def constrained(engine, cases, **params):
    prompts = [[ChatMessage("user", text)] for text, _ in cases]
    return generate(engine, prompts, [SamplingParams(max_tokens=96, temperature=0.0, grammar=g, **params)
                                      for _, g in cases])


@pytest.fixture(scope="module")
def reference(engine):
    """Plain constrained decoding: no drafts at all (per-request cap 0)."""
    outs = constrained(engine, CASES, num_speculative_tokens=0)
    assert all(o.num_draft_tokens == 0 for o in outs)
    return outs


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory, model_path) -> str:
    """A random eagle head (its drafts are seldom right: the point is that verification under a grammar,
    grammar-forced drafts in between, keeps the output exact)."""
    from random_heads import write_random_head

    from engine.model.gguf_loader import GGUFModel

    return str(write_random_head(tmp_path_factory.mktemp("heads") / "eagle", "eagle", GGUFModel(model_path).config))


@pytest.mark.parametrize("spec", METHODS + ["eagle"], ids=lambda m: m if isinstance(m, str) else m["method"])
def test_greedy_constrained_output_is_identical_with_speculation(make_engine, reference, spec, request):
    if spec == "eagle":
        spec = {"method": "eagle", "num_speculative_tokens": 3, "model": request.getfixturevalue("eagle_head")}
    engine = make_engine(speculative_config=json.dumps(spec))
    alone = [constrained(engine, [case])[0] for case in CASES]
    together = constrained(engine, CASES + CASES[:2])
    want = [r.token_ids for r in reference]
    assert [o.token_ids for o in alone] == want
    assert [o.token_ids for o in together] == want + want[:2]
    assert sum(o.num_accepted_tokens for o in alone) > 0
    json.loads(alone[0].text) and jsonschema.validate(json.loads(alone[0].text), PERSON)


def test_forced_tokens_are_free_drafts(engine, reference):
    """Without a proposer, the grammar's forced tokens (JSON keys, punctuation) are drafted and accepted."""
    outs = constrained(engine, CASES[:1])
    assert outs[0].token_ids == reference[0].token_ids
    assert outs[0].num_grammar_tokens > 0 and outs[0].num_accepted_tokens >= outs[0].num_grammar_tokens
    assert engine.grammars.masked_rows > 0


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    kind = rng.choice(["object", "object", "enum", "array", "integer", "number", "string", "boolean"] if depth < 2
                      else ["enum", "integer", "number", "string", "boolean"])
    if kind == "object":
        names = rng.choice(["id", "name", "kind", "size", "tags", "price", "ok", "note"], rng.integers(1, 4), False)
        props = {str(n): random_schema(rng, depth + 1) for n in names}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    if kind == "enum":
        return {"enum": [str(v) for v in rng.choice(["red", "green", "blue", "small", "large"], 3, False)]}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "maxItems": int(rng.integers(1, 4))}
    if kind in ("integer", "number"):
        lo = int(rng.integers(-50, 50))
        bounded = {"type": kind, "minimum": lo, "maximum": lo + int(rng.integers(1, 1000))}
        # A greedy small model may write digits forever; a bounded number of decimals ends every number.
        return bounded if kind == "integer" else {**bounded, "multipleOf": 0.25}
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(1, 16))}
    return {"type": "boolean"}


def test_random_schemas_always_parse_and_validate(engine):
    rng = np.random.default_rng(17)
    schemas = [random_schema(rng) for _ in range(100)]
    cases = [(f"Fill in this JSON schema with plausible values: {json.dumps(s)}",
              llguidance.LLMatcher.grammar_from_json_schema(s, overrides={"whitespace_flexible": False}))
             for s in schemas]
    outs = generate(engine, [[ChatMessage("user", text)] for text, _ in cases],
                    [SamplingParams(max_tokens=256, temperature=0.0, grammar=g) for _, g in cases])
    for schema, out in zip(schemas, outs):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)
