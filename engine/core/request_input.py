"""Turn a Generate message into prompt token ids and check its parameters (clear errors, field named)."""

from __future__ import annotations

import json
import math

from engine.errors import InvalidRequest
from engine.model.tool_prompt import render_inputs
from engine.serving.protocol import (
    MAX_BAD_WORDS,
    RESERVED_TEMPLATE_KWARGS,
    Detokenize,
    Generate,
    SamplingParams,
    Tokenize,
    Tokens,
)

MAX_STOP_STRINGS = 64
MAX_LOGPROBS = 20


def prompt_token_ids(msg: Generate, tokenizer) -> list[int]:
    if msg.messages is not None:
        if not msg.messages:
            raise InvalidRequest("messages must not be empty", "messages")
        messages, context = render_inputs(msg.messages, msg.tools_json, tokenizer.template_source())
        kwargs = _template_kwargs(msg.chat_template_kwargs_json)
        try:
            text = tokenizer.apply_chat_template(messages, msg.add_generation_prompt, msg.continue_final_message,
                                                 **kwargs, **context)
        except ValueError as exc:  # the template refused the conversation (raise_exception), or nothing to continue
            raise InvalidRequest(str(exc).removeprefix("messages: "), "messages") from exc
        ids = tokenizer.encode(text, msg.add_special_tokens)
        param = "messages"
    elif msg.prompt_token_ids is not None:
        ids = list(msg.prompt_token_ids)
        bad = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (0..{tokenizer.vocab_size - 1})", "prompt")
        param = "prompt"
    elif msg.prompt is not None:
        ids = tokenizer.encode(msg.prompt, msg.add_special_tokens)
        param = "prompt"
    else:
        raise InvalidRequest("either prompt or messages is required", "prompt")
    if not ids:
        raise InvalidRequest("the prompt is empty", param)
    keep = msg.params.truncate_prompt_tokens
    if keep is not None:  # vLLM's: the prompt's last `keep` tokens (validate_params refuses keep < 1)
        ids = ids[-keep:]
    return ids


def _template_kwargs(kwargs_json: str | None) -> dict:
    kwargs = json.loads(kwargs_json) if kwargs_json else {}
    if not isinstance(kwargs, dict) or RESERVED_TEMPLATE_KWARGS & kwargs.keys():
        raise InvalidRequest("chat_template_kwargs must be an object whose keys are not "
                             + ", ".join(sorted(RESERVED_TEMPLATE_KWARGS)), "chat_template_kwargs")
    return kwargs


def tokens_reply(msg: Tokenize | Detokenize, tokenizer) -> Tokens:
    """/tokenize (a prompt's ids, as a Generate with its prompt fields would get them) or /detokenize."""
    if isinstance(msg, Detokenize):
        if any(not 0 <= t < tokenizer.vocab_size for t in msg.token_ids):
            raise InvalidRequest("tokens must be token ids of this model's vocabulary", "tokens")
        return Tokens(msg.request_id, text=tokenizer.decode(msg.token_ids))
    fields = {f: getattr(msg, f) for f in ("prompt", "messages", "tools_json", "add_generation_prompt",
                                           "chat_template_kwargs_json", "continue_final_message", "add_special_tokens")}
    ids = prompt_token_ids(Generate(msg.request_id, SamplingParams(), **fields), tokenizer)
    return Tokens(msg.request_id, token_ids=[int(t) for t in ids])


def validate_params(p: SamplingParams, num_prompt_tokens: int, max_model_len: int, vocab_size: int) -> None:
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(
            f"the prompt has {num_prompt_tokens} tokens; this model's maximum context length is "
            f"{max_model_len} tokens including at least one output token",
            "prompt", "context_length_exceeded",
        )
    if not isinstance(p.max_tokens, int) or p.max_tokens < 1:
        raise InvalidRequest("max_tokens must be an integer >= 1", "max_tokens")
    if not (math.isfinite(p.temperature) and 0.0 <= p.temperature <= 2.0):
        raise InvalidRequest("temperature must be between 0 and 2", "temperature")
    if not (math.isfinite(p.top_p) and 0.0 < p.top_p <= 1.0):
        raise InvalidRequest("top_p must be in (0, 1]", "top_p")
    if p.top_k < 0:
        raise InvalidRequest("top_k must be >= 0 (0 = off)", "top_k")
    if p.truncate_prompt_tokens is not None and not 1 <= p.truncate_prompt_tokens:
        raise InvalidRequest("truncate_prompt_tokens must be at least 1", "truncate_prompt_tokens")
    if p.seed is not None and not 0 <= p.seed < 2**63:
        raise InvalidRequest("seed must be an integer in [0, 2**63)", "seed")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if any(not 0 <= t < vocab_size for t in p.stop_token_ids):
        raise InvalidRequest("stop_token_ids must be token ids of this model's vocabulary", "stop_token_ids")
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None and not 0 <= getattr(p, name) <= MAX_LOGPROBS:
            raise InvalidRequest(f"{name} must be between 0 and {MAX_LOGPROBS}", name)
    _check_processing(p, vocab_size)
    if p.num_speculative_tokens is not None and not 0 <= p.num_speculative_tokens <= 64:
        raise InvalidRequest("speculative.n_max must be between 0 and 64", "speculative")


def _check_processing(p: SamplingParams, vocab_size: int) -> None:
    """The parameters engine/core/logits_processing.py applies."""
    for name in ("presence_penalty", "frequency_penalty"):
        if not (math.isfinite(getattr(p, name)) and -2.0 <= getattr(p, name) <= 2.0):
            raise InvalidRequest(f"{name} must be between -2 and 2", name)
    if not (math.isfinite(p.repetition_penalty) and 0.0 < p.repetition_penalty <= 2.0):
        raise InvalidRequest("repetition_penalty must be in (0, 2]", "repetition_penalty")
    if not (math.isfinite(p.min_p) and 0.0 <= p.min_p <= 1.0):
        raise InvalidRequest("min_p must be between 0 and 1", "min_p")
    if not isinstance(p.min_tokens, int) or not 0 <= p.min_tokens <= p.max_tokens:
        raise InvalidRequest("min_tokens must be an integer between 0 and max_tokens", "min_tokens")
    if any(not 0 <= t < vocab_size for t in p.allowed_token_ids):
        raise InvalidRequest("allowed_token_ids must be token ids of this model's vocabulary", "allowed_token_ids")
    if p.allowed_token_ids and p.grammar is not None:
        raise InvalidRequest("allowed_token_ids cannot be combined with an output constraint (response_format, "
                             "tools, a regex or grammar)", "allowed_token_ids")
    if len(p.bad_words) > MAX_BAD_WORDS or not all(0 < len(w.strip()) <= 256 for w in p.bad_words):
        raise InvalidRequest(f"bad_words takes at most {MAX_BAD_WORDS} words of 1..256 characters", "bad_words")
    if any(not 0 <= t < vocab_size for t in p.logit_bias):
        raise InvalidRequest("logit_bias keys must be token ids of this model's vocabulary", "logit_bias")
    if any(not (math.isfinite(v) and -100.0 <= v <= 100.0) for v in p.logit_bias.values()):
        raise InvalidRequest("logit_bias values must be between -100 and 100", "logit_bias")


def prompt_scoring_field(params: SamplingParams) -> str | None:
    """The field that asks for the request's prompt positions to be scored (engine/core/prompt_echo.py), so that
    every one must be computed and none taken from cached prefix blocks; None when none does."""
    if params.prompt_logprobs is not None:
        return "prompt_logprobs"
    return "echo" if params.echo and params.logprobs is not None else None


def scores_prompt(params: SamplingParams) -> bool:
    return prompt_scoring_field(params) is not None


def prompt_top(params: SamplingParams) -> int:
    """How many top alternatives each scored prompt position carries: the larger of the two asks."""
    echo_top = params.logprobs if params.echo and params.logprobs is not None else 0
    return max(echo_top, params.prompt_logprobs or 0)
