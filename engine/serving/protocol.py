"""Wire protocol between the gateway and engine workers.

Every message is a msgspec Struct in one tagged union per direction, encoded as
msgpack and decoded by one typed decoder. Nothing here is ever pickled.

Transport: the gateway binds a ZeroMQ ROUTER socket; each worker connects a
DEALER socket (identity = worker id). One frame per message.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 4  # 2: Tokenize, Detokenize and Tokens; 3: min_tokens, allowed_token_ids, chat_template_kwargs,
# include_stop_str_in_output, truncate_prompt_tokens, bad_words; 4: continue_final_message, prompt_logprobs,
# skip_special_tokens, add_special_tokens (a worker that ignored them would answer another question than the one asked)
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # gateway binds, workers connect ($SPECULANT_ENGINE_ENDPOINT)
# chat template variables a request's chat_template_kwargs may not set: the renderer's own
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})
MAX_BAD_WORDS = 128  # words in one bad_words (the gateway and the engine both check it)


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """Per-request generation settings (validated by the gateway and again by the engine)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None = no logprobs; k >= 0 = chosen token + top-k alternatives
    # Per-request speculation cap (llama.cpp's speculative.n_max): None = server default, 0 = off.
    num_speculative_tokens: int | None = None
    speculative_method: str | None = None  # another installed proposer for this request (None = the server's)
    include_provenance: bool = False  # opt-in per-token "drafted vs target" flags on the stream
    # Constrained decoding: an llguidance grammar (the JSON the gateway builds from response_format or
    # the `speculant` regex / grammar extension, already validated there). None = unconstrained.
    grammar: str | None = None
    # OpenAI's penalties and logit_bias (token id -> added to that logit), vLLM's repetition_penalty and
    # min_p (0 = off): engine/core/logits_processing.py
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = {}
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # vLLM's min_tokens (no stop token and no stop string before this many output tokens) and allowed_token_ids
    # (only these may be sampled; [] = all): engine/core/logits_processing.py
    min_tokens: int = 0
    allowed_token_ids: list[int] = []
    # vLLM's: a stop string (or a stop_token_ids token's text) stays at the end of the text; only the last
    # truncate_prompt_tokens tokens of the prompt are kept (None = all)
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens' text (e.g. an ignored EOS) in the output
    bad_words: list[str] = []  # vLLM's: engine/core/logits_processing.py
    # Completions' echo: the first Output carries the prompt's text and, with `logprobs`, each prompt token's
    # logprob (engine/core/prompt_echo.py)
    echo: bool = False
    # vLLM's prompt_logprobs: the first Output carries each prompt token's logprob, its rank and this many top
    # alternatives (None = off); with echo and logprobs too, the entries carry the larger count
    prompt_logprobs: int | None = None
    # vLLM's priority: on an engine started with --scheduling-policy priority, lower values are admitted first and
    # preempted last (ties: arrival order); an fcfs engine refuses anything but 0
    priority: int = 0

    def stop_ids(self, eos_ids) -> set[int]:
        """The tokens that end this request: its stop_token_ids, and the model's EOS ids unless ignore_eos."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_ids))


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str
    # Tool calling: an assistant turn's calls (the OpenAI `tool_calls` list as JSON text), and a "tool"
    # turn's answer to one of them.
    tool_calls_json: str | None = None
    tool_call_id: str | None = None
    name: str | None = None


# ---------------------------------------------------------------- gateway -> worker


class Generate(msgspec.Struct, tag="generate", frozen=True):
    request_id: str
    params: SamplingParams
    prompt: str | None = None  # completions: raw text
    prompt_token_ids: list[int] | None = None  # completions: pre-tokenized prompt
    messages: list[ChatMessage] | None = None  # chat: rendered with the model's chat template
    tools_json: str | None = None  # chat: the request's `tools` (OpenAI shape, JSON text), rendered into the prompt
    add_generation_prompt: bool = True
    # chat: vLLM's chat_template_kwargs (a JSON object's text): extra variables the chat template sees
    chat_template_kwargs_json: str | None = None
    continue_final_message: bool = False  # chat: the prompt ends inside the final message (a prefilled answer)
    add_special_tokens: bool = True  # vLLM's: False adds no BOS to a text prompt (token ids are kept as sent)


class Abort(msgspec.Struct, tag="abort", frozen=True):
    request_id: str


class GatewayHello(msgspec.Struct, tag="gateway_hello", frozen=True):
    """Sent by a (re)started gateway: the worker aborts requests the gateway no longer knows."""

    gateway_id: str
    live_request_ids: list[str] = []


class Tokenize(msgspec.Struct, tag="tokenize", frozen=True):
    """/tokenize: a prompt's token ids, as a Generate with these prompt fields would see them."""

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools_json: str | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs_json: str | None = None
    continue_final_message: bool = False
    add_special_tokens: bool = True


class Detokenize(msgspec.Struct, tag="detokenize", frozen=True):
    """/detokenize: token ids as text."""

    request_id: str
    token_ids: list[int] = []


ToWorker = Generate | Abort | GatewayHello | Tokenize | Detokenize


# ---------------------------------------------------------------- worker -> gateway


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    token: str
    logprob: float | None  # None: a prompt's first token (nothing before it to predict it)
    top: list[tuple[int, str, float]] = []  # (token_id, token text, logprob)
    rank: int = 0  # 1 + how many tokens the row scores above token_id (0: no logprob)


class Output(msgspec.Struct, frozen=True):
    """What one engine step produced for one request."""

    request_id: str
    text: str  # detokenized delta; never contains text past a stop string
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    prompt_tokens: int = 0
    completion_tokens: int = 0  # running total
    logprobs: list[TokenLogprob] | None = None
    # Provenance of each new token: True = an accepted draft token, False = made by the target.
    drafted: list[bool] | None = None
    num_drafts: int = 0  # running totals of the request's speculation
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_grammar_tokens: int = 0  # running total of accepted draft tokens the grammar forced (free drafts)
    # Seconds the request waited before it was first scheduled; set on its first output only.
    # The worker fills it in when the engine leaves it None.
    queue_time: float | None = None
    grammar_forced: list[bool] | None = None  # with provenance: which accepted drafts the grammar forced
    # On a request's first Output only: with `echo` the prompt as text; with echo and `logprobs`, or with
    # `prompt_logprobs`, an entry per prompt token (the first one's logprob is None)
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class Outputs(msgspec.Struct, tag="outputs", frozen=True):
    items: list[Output]


class RequestError(msgspec.Struct, tag="request_error", frozen=True):
    """A request the worker refused or could not finish (OpenAI error fields)."""

    request_id: str
    message: str
    status: int = 400
    error_type: str = "invalid_request_error"  # OpenAI `error.type` (`type` is msgspec's tag field)
    param: str | None = None
    code: str | None = None


class WorkerStats(msgspec.Struct, frozen=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = []
    num_grammar_tokens: int = 0  # accepted draft tokens forced by a grammar, all requests
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0


class Ready(msgspec.Struct, tag="ready", frozen=True):
    worker_id: str
    model: str
    max_model_len: int
    protocol_version: int = PROTOCOL_VERSION
    pid: int = 0
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    available_methods: list[str] = []  # installed proposers a request may pick (`speculative.method`)


class Heartbeat(msgspec.Struct, tag="heartbeat", frozen=True):
    worker_id: str
    stats: WorkerStats


class Goodbye(msgspec.Struct, tag="goodbye", frozen=True):
    worker_id: str
    reason: str = "shutdown"


class Tokens(msgspec.Struct, tag="tokens", frozen=True):
    """The answer to Tokenize (token_ids) or Detokenize (text)."""

    request_id: str
    token_ids: list[int] = []
    text: str = ""


ToGateway = Ready | Heartbeat | Outputs | RequestError | Goodbye | Tokens

_encoder = msgspec.msgpack.Encoder()
worker_decoder = msgspec.msgpack.Decoder(ToWorker)
gateway_decoder = msgspec.msgpack.Decoder(ToGateway)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)
