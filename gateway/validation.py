"""Range checks for OpenAI requests, and their translation into the engine's `Generate`.

Every failure is an HTTP 400 naming the field. Limits we chose (not OpenAI's):
at most 16 stop strings of at most 256 characters each, at most 256 stop token ids,
a per-request speculation cap `speculative.n_max` in 0..64, `speculative.method` a proposer name, at
most 1,024 tokens in `logit_bias` and 65,536 in `allowed_token_ids`, at most 128 `bad_words`, at most 16
choices (`n`) and at most 64 prompts in one completions request.
Output constraints (`response_format`, `speculant.regex` / `speculant.grammar`) are compiled and
checked in `gateway.constraints`; tools and tool_choice in `gateway.tools` and `gateway.tool_grammar`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import msgspec

from engine.serving import protocol
from engine.serving.protocol import MAX_BAD_WORDS, RESERVED_TEMPLATE_KWARGS
from gateway.constraints import grammar_for
from gateway.errors import OpenAIError, bad_request
from gateway.openai_schema import ChatCompletionRequest, CompletionRequest, SamplingRequest
from gateway.tool_grammar import tool_grammar
from gateway.tools import tool_message_fields, tool_plan

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20
MAX_SPEC_TOKENS = 64
MAX_CHOICES = 16  # n
MAX_PROMPTS = 64  # prompts in one completions request
MAX_LOGIT_BIAS = 1024  # tokens in one logit_bias
MAX_ALLOWED_TOKENS = 65536  # tokens in one allowed_token_ids
MAX_TEMPLATE_KWARGS_CHARS = 65536  # chat_template_kwargs as JSON
MAX_TOKEN_ID = 2**31 - 1  # token ids and top_k are int32 in the engine; the worker checks the vocabulary
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclasses.dataclass(slots=True)
class RequestOptions:
    """What the response side needs to know about a validated request."""

    kind: str  # "chat" | "completion"
    model: str | None  # as the client sent it (None: use the served name)
    stream: bool
    include_usage: bool
    logprobs: int | None  # None = off; k = chosen token + k alternatives
    provenance: bool
    max_tokens: int | None  # None = not given (chat: up to the context limit)
    max_tokens_param: str
    tool_names: tuple[str, ...] = ()  # chat with tools (tool_choice not "none"): parse calls out of the answer
    n: int = 1  # choices: one engine request each
    echo: bool = False  # completions: the answer starts with the prompt (and its tokens' logprobs)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (the engine still makes one token, unsent)
    echo_text: str = ""  # chat's echo: the final message's text, shown before the answer
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and this many alternatives
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"


@dataclasses.dataclass(slots=True)
class Validated:
    # the prompt fields of `Generate`, one dict per prompt (completions may send several): prompt |
    # prompt_token_ids | messages (+ add_generation_prompt)
    fields: list[dict]
    opts: RequestOptions
    params: protocol.SamplingParams  # max_tokens still to be resolved against the worker

    @property
    def num_choices(self) -> int:
        return len(self.fields) * self.opts.n

    def choice(self, i: int) -> "Validated":
        """Choice i of the response, as OpenAI orders them: prompt i // n, its choice j = i % n. With a seed,
        choice j samples with seed + j, so a prompt's choices differ, each is reproducible, and choice 0
        samples as the prompt would alone."""
        prompt, j = divmod(i, self.opts.n)
        params = self.params
        if params.seed is not None and j:
            params = msgspec.structs.replace(params, seed=(params.seed + j) % 2**63)
        return dataclasses.replace(self, fields=[self.fields[prompt]], params=params)


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise bad_request(message, param)


def _unsupported(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise OpenAIError(400, message, param=param, code="unsupported_parameter")


def sampling_params(req: SamplingRequest, opts: RequestOptions,
                    grammar_of: Callable[[SamplingRequest], str | None] = grammar_for) -> protocol.SamplingParams:
    """Range checks shared by both endpoints; max_tokens is resolved per worker in `build_generate`."""
    temperature = 1.0 if req.temperature is None else req.temperature
    _require(0.0 <= temperature <= 2.0, "temperature", "temperature must be between 0 and 2")
    top_p = 1.0 if req.top_p is None else req.top_p
    _require(0.0 < top_p <= 1.0, "top_p", "top_p must be in (0, 1]")
    top_k = 0 if req.top_k is None else req.top_k
    _require(-1 <= top_k <= MAX_TOKEN_ID, "top_k", "top_k must be -1 (off), 0 (off) or a positive integer")
    _require(req.seed is None or 0 <= req.seed < 2**63, "seed", "seed must be an integer in [0, 2**63)")
    _require(req.priority is None or -MAX_PRIORITY <= req.priority <= MAX_PRIORITY, "priority",
             f"priority must be an integer in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    _require(req.truncate_prompt_tokens is None or 1 <= req.truncate_prompt_tokens <= MAX_TOKEN_ID,
             "truncate_prompt_tokens", "truncate_prompt_tokens must be a positive number of tokens")
    _require(req.min_tokens is None or 0 <= req.min_tokens <= (opts.max_tokens or MAX_TOKEN_ID), "min_tokens",
             f"min_tokens must be between 0 and {opts.max_tokens_param}")
    return protocol.SamplingParams(
        max_tokens=opts.max_tokens or 1,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),
        seed=req.seed,
        stop=_stop_strings(req.stop),
        stop_token_ids=_stop_token_ids(req.stop_token_ids),
        ignore_eos=bool(req.ignore_eos),
        logprobs=opts.logprobs,
        prompt_logprobs=opts.prompt_logprobs,
        num_speculative_tokens=_spec_cap(req),
        speculative_method=_spec_method(req),
        include_provenance=opts.provenance,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias),
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        min_p=req.min_p or 0.0,
        min_tokens=req.min_tokens or 0,
        allowed_token_ids=_allowed_token_ids(req.allowed_token_ids),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
        bad_words=_bad_words(req.bad_words),
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        priority=req.priority or 0,
        grammar=grammar_of(req),  # last: a first-seen schema is the costliest check
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (as JSON object keys) -> a bias in -100..100 added to that logit."""
    bias = bias or {}
    _require(len(bias) <= MAX_LOGIT_BIAS, "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
    out = {}
    for key, value in bias.items():
        _require(key.isascii() and key.isdigit() and int(key) <= MAX_TOKEN_ID, "logit_bias",
                 f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        _require(-100.0 <= value <= 100.0, "logit_bias", "logit_bias values must be between -100 and 100")
        out[int(key)] = float(value)
    return out


def _bad_words(words: list[str] | None) -> list[str]:
    words = list(words or [])
    _require(len(words) <= MAX_BAD_WORDS and all(0 < len(w.strip()) <= 256 for w in words), "bad_words",
             f"bad_words takes at most {MAX_BAD_WORDS} words of 1..256 characters")
    return words


def _allowed_token_ids(ids: list[int] | None) -> list[int]:
    """vLLM's allowed_token_ids: only these may be sampled (the worker checks them against its vocabulary)."""
    if ids is None:
        return []
    _require(0 < len(ids) <= MAX_ALLOWED_TOKENS, "allowed_token_ids",
             f"allowed_token_ids must list 1..{MAX_ALLOWED_TOKENS} token ids")
    _require(all(0 <= i <= MAX_TOKEN_ID for i in ids), "allowed_token_ids",
             "allowed_token_ids must be non-negative token ids")
    return list(ids)


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    _require(len(stops) <= MAX_STOP_STRINGS, "stop", f"stop accepts at most {MAX_STOP_STRINGS} strings")
    for s in stops:
        _require(0 < len(s) <= MAX_STOP_LENGTH, "stop", f"each stop string must have 1..{MAX_STOP_LENGTH} characters")
    return stops


_METHOD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def _stop_token_ids(ids: list[int] | None) -> list[int]:
    ids = list(ids or [])
    _require(len(ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
    _require(all(0 <= i <= MAX_TOKEN_ID for i in ids), "stop_token_ids",
             "stop_token_ids must be non-negative token ids")
    return ids


def _spec_method(req: SamplingRequest) -> str | None:
    method = req.speculative.method if req.speculative is not None else None
    if method is not None:
        _require(_METHOD_NAME.fullmatch(method) is not None, "speculative.method",
                 "speculative.method must be a proposer name (letters, digits, '_', '-', '.'; at most 64)")
    return method


def _spec_cap(req: SamplingRequest) -> int | None:
    n_max, param = req.speculative_n_max, "speculative.n_max"
    if req.speculative is not None and req.speculative.n_max is not None:
        n_max = req.speculative.n_max
    if n_max is not None:
        _require(0 <= n_max <= MAX_SPEC_TOKENS, param, f"speculative.n_max must be in 0..{MAX_SPEC_TOKENS}")
    return n_max


# vLLM's sampling extensions we do not implement, with their values that ask for nothing (None: absent)
_VLLM_UNSUPPORTED = (("use_beam_search", (None, False)), ("length_penalty", (None, 1.0)),
                     ("logits_processors", (None, [])))
MAX_PRIORITY = 2**31 - 1  # |priority|


def _common_checks(req: SamplingRequest) -> None:
    """Fields we parse but cannot honour: a non-default value is a 400, never silently ignored."""
    for name, inert in _VLLM_UNSUPPORTED:
        _unsupported(getattr(req, name) in inert, name, f"{name} is not supported by this server")
    _require(req.n is None or 1 <= req.n <= MAX_CHOICES, "n", f"n must be in 1..{MAX_CHOICES}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        _require(value is None or -2.0 <= value <= 2.0, name, f"{name} must be between -2 and 2")
    rp = req.repetition_penalty
    _require(rp is None or 0.0 < rp <= 2.0, "repetition_penalty", "repetition_penalty must be in (0, 2]")
    _require(req.min_p is None or 0.0 <= req.min_p <= 1.0, "min_p", "min_p must be between 0 and 1")
    _require(bool(req.stream) or req.stream_options is None, "stream_options",
             "stream_options can only be set when stream is true")
    _prompt_logprobs_checks(req)
    echo_only = isinstance(req, CompletionRequest) and bool(req.echo) and req.max_tokens == 0  # the prompt alone
    _require(req.max_tokens is None or req.max_tokens >= 1 or echo_only, "max_tokens",
             "max_tokens must be at least 1 (0 only with echo)")


def _prompt_logprobs_checks(req: SamplingRequest) -> None:
    """vLLM's prompt_logprobs: 0..MAX_LOGPROBS alternatives, not streamed (as in vLLM); -1 (vLLM's whole
    vocabulary) is refused."""
    k = req.prompt_logprobs
    if k is None:
        return
    _unsupported(k != -1, "prompt_logprobs", f"prompt_logprobs -1 (the whole vocabulary) is not supported; "
                                             f"ask for at most {MAX_LOGPROBS} alternatives")
    _require(0 <= k <= MAX_LOGPROBS, "prompt_logprobs", f"prompt_logprobs must be an integer in 0..{MAX_LOGPROBS}")
    _require(not req.stream, "prompt_logprobs", "prompt_logprobs are not available when stream is true")


def _options(req: SamplingRequest, kind: str, logprobs: int | None, max_tokens, max_tokens_param) -> RequestOptions:
    return RequestOptions(
        kind=kind,
        model=req.model,
        stream=bool(req.stream),
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        logprobs=logprobs,
        provenance=bool(req.speculant and req.speculant.provenance),
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        n=req.n or 1,
        prompt_logprobs=req.prompt_logprobs,
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
    )


def validate_completion(req: CompletionRequest) -> Validated:
    """Checks a completions body; returns the prompt fields of `Generate` and the options."""
    _common_checks(req)
    _unsupported(req.best_of in (None, req.n or 1), "best_of", "best_of must equal n (ranking choices is not supported)")
    _unsupported(req.suffix is None, "suffix", "suffix is not supported")
    _require(req.logprobs is None or 0 <= req.logprobs <= MAX_LOGPROBS, "logprobs",
             f"logprobs must be an integer in 0..{MAX_LOGPROBS}")
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else max(req.max_tokens, 1)
    opts = _options(req, "completion", req.logprobs, max_tokens, "max_tokens")
    opts.echo, opts.echo_only = bool(req.echo), bool(req.echo) and req.max_tokens == 0
    fields = _with_special_tokens(_prompt_fields(req.prompt), req.add_special_tokens)
    params = msgspec.structs.replace(sampling_params(req, opts), echo=opts.echo)
    return Validated(fields, opts, params)


def _with_special_tokens(fields: list[dict], add: bool | None) -> list[dict]:
    """vLLM's add_special_tokens: false asks the worker to add no BOS to the prompt (None, true: as the model does)."""
    return fields if add is not False else [{**f, "add_special_tokens": False} for f in fields]


def _prompt_fields(prompt) -> list[dict]:
    """The prompts of a completions request: a string or a list of token ids, or a list of either."""
    _require(prompt is not None, "prompt", "prompt is required")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _require(len(prompt) <= MAX_PROMPTS, "prompt", f"at most {MAX_PROMPTS} prompts in one request")
        return [_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_one_prompt(prompt, "prompt")]


def _one_prompt(prompt, param: str) -> dict:
    if isinstance(prompt, str):
        _require(len(prompt) > 0, param, "prompt must not be empty")
        return {"prompt": prompt}
    _require(isinstance(prompt, list), param, "prompt must be a string or a list of token ids")
    _require(len(prompt) > 0, param, "prompt must not be empty")
    is_ids = all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in prompt)
    _require(is_ids, param, "a token-id prompt must be a list of non-negative integers")
    return {"prompt_token_ids": list(prompt)}


def validate_chat(req: ChatCompletionRequest) -> Validated:
    """Checks a chat body; returns the prompt fields of `Generate` and the options."""
    _common_checks(req)
    plan = tool_plan(req)
    mct = req.max_completion_tokens
    _require(mct is None or mct >= 1, "max_completion_tokens", "max_completion_tokens must be at least 1")
    top = req.top_logprobs
    _require(top is None or 0 <= top <= MAX_LOGPROBS, "top_logprobs", f"top_logprobs must be in 0..{MAX_LOGPROBS}")
    _require(top is None or bool(req.logprobs), "top_logprobs", "top_logprobs requires logprobs to be true")
    logprobs = (top or 0) if req.logprobs else None
    max_tokens, param = (mct, "max_completion_tokens") if mct is not None else (req.max_tokens, "max_tokens")
    opts = _options(req, "chat", logprobs, max_tokens, param)
    opts.tool_names = plan.names if plan.active else ()
    messages, ending = _messages(req), prompt_ending(req.add_generation_prompt, req.continue_final_message)
    opts.echo_text = _chat_echo(req.echo, messages[-1], ending["add_generation_prompt"])
    fields = _with_special_tokens([{"messages": messages, "tools_json": plan.tools_json(), **ending,
                                    "chat_template_kwargs_json": template_kwargs_json(req.chat_template_kwargs)}],
                                  req.add_special_tokens)
    return Validated(fields, opts, sampling_params(req, opts, lambda r: tool_grammar(r, plan)))


def _chat_echo(echo: bool | None, final: protocol.ChatMessage, opens_a_turn: bool) -> str:
    """vLLM's chat echo: the final message's text starts the answer when it is in the answer's role (an assistant
    message, or any message the prompt leaves open, as continue_final_message does); else nothing."""
    return final.content if echo and (final.role == "assistant" or not opens_a_turn) else ""


def prompt_ending(add_generation_prompt: bool | None, continue_final_message: bool | None) -> dict:
    """How a chat prompt ends, as Generate / Tokenize fields: the assistant's turn opened (add_generation_prompt,
    the default), or with vLLM's continue_final_message the final message left open for the model to continue
    (add_generation_prompt then defaults to false; both true is a 400, as in vLLM)."""
    cont = bool(continue_final_message)
    _require(not (cont and add_generation_prompt), "add_generation_prompt",
             "add_generation_prompt and continue_final_message cannot both be true")
    return {"add_generation_prompt": add_generation_prompt is not False and not cont, "continue_final_message": cont}


def template_kwargs_json(kwargs: dict | None) -> str | None:
    """vLLM's chat_template_kwargs (e.g. Qwen3's {"enable_thinking": false}) as JSON text for the worker."""
    if not kwargs:
        return None
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    _require(not reserved, "chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(reserved)}")
    text = msgspec.json.encode(kwargs).decode()
    _require(len(text) <= MAX_TEMPLATE_KWARGS_CHARS, "chat_template_kwargs",
             f"chat_template_kwargs is too long (at most {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON)")
    return text


def _messages(req: ChatCompletionRequest) -> list[protocol.ChatMessage]:
    _require(len(req.messages) > 0, "messages", "messages must not be empty")
    out = []
    for i, m in enumerate(req.messages):
        role = CHAT_ROLES.get(m.role)
        _unsupported(role is not None, f"messages[{i}].role",
                     f"role {m.role!r} is not supported (use system, developer, user, assistant or tool)")
    for i, (m, tool_fields) in enumerate(zip(req.messages, tool_message_fields(req.messages))):
        content = _content(m.content, i, may_be_null="tool_calls_json" in tool_fields)
        out.append(protocol.ChatMessage(role=CHAT_ROLES[m.role], content=content, **tool_fields))
    return out


def _content(content, i: int, may_be_null: bool = False) -> str:
    param = f"messages[{i}].content"
    if content is None and may_be_null:  # an assistant turn that only calls tools
        return ""
    _require(content is not None, param, "message content must be a string or a list of text parts")
    if isinstance(content, str):
        return content
    for part in content:
        _unsupported(part.type == "text" and part.text is not None, param, "only text content parts are supported")
    return "\n".join(part.text for part in content)


def build_generate(request_id: str, validated: Validated, max_model_len: int) -> protocol.Generate:
    """The engine request for one worker; the worker's `max_model_len` bounds max_tokens."""
    opts = validated.opts
    max_tokens = opts.max_tokens if opts.max_tokens is not None else max_model_len
    _require(max_tokens <= max_model_len, opts.max_tokens_param,
             f"{opts.max_tokens_param} must be at most {max_model_len} (the model's context length)")
    params = msgspec.structs.replace(validated.params, max_tokens=max_tokens)
    (fields,) = validated.fields  # one prompt: Validated.choice's
    return protocol.Generate(request_id=request_id, params=params, **fields)
