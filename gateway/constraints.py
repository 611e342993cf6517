"""Structured output: OpenAI `response_format` and the `speculant` regex / grammar extension,
compiled into one llguidance grammar (the string `SamplingParams.grammar` carries to the worker).

Mapping (at most one constraint per request; two are a 400):
- `response_format: {"type": "text"}` (or absent): no grammar;
- `{"type": "json_object"}`: the JSON schema `{"type": "object"}`;
- `{"type": "json_schema", "json_schema": {"schema": {...}, "strict": ...}}`: that schema. With
  `strict: true` keywords llguidance does not implement are a 400; otherwise they are ignored (the
  rest of the schema is still enforced), as OpenAI's non-strict mode promises no exact match;
- `speculant.regex`: the regex (Rust `regex` syntax), matched by the whole output;
- `speculant.grammar` with `speculant.grammar_syntax` "lark" (default) or "gbnf" (llama.cpp);
- vLLM's `structured_outputs` `json` / `regex` / `choice` / `grammar` / `json_object`, and its earlier
  `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (a grammar with `::=` is GBNF, else
  Lark; a choice becomes the regex of its strings, escaped);
- llama.cpp server's `grammar` (GBNF) and `json_schema`.

Conversion and validation (no tokenizer: the worker checks the grammar against its vocabulary)
are cached in a small LRU keyed by a hash of the constraint's canonical JSON, so a repeated
schema compiles once. Canonical means compact, not key-sorted: the order of `properties` is the
order the fields are generated in, so two schemas differing only in that order are different.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading

import msgspec
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from gateway.errors import bad_request
from gateway.openai_schema import ResponseFormat, SamplingRequest, SpeculantOptions, StructuredOutputs

log = logging.getLogger("speculant.gateway")

MAX_CONSTRAINT_CHARS = 256 * 1024  # our limit: a first-seen constraint compiles on the event loop
CACHE_SIZE = 256
MAX_ERROR_CHARS = 1000
JSON_OBJECT_SCHEMA = '{"type":"object"}'
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclasses.dataclass(frozen=True, slots=True)
class Constraint:
    param: str  # the request field an error names
    kind: str  # "json_schema" | "regex" | "lark" | "gbnf"
    source: str  # the schema as JSON, the regex or the grammar text
    lenient: bool = False  # json_schema only: ignore keywords llguidance does not implement

    def key(self) -> bytes:
        return hashlib.sha256(msgspec.json.encode([self.kind, self.lenient, self.source])).digest()


@dataclasses.dataclass(frozen=True, slots=True)
class Compiled:
    grammar: str | None  # the llguidance grammar, or None when the constraint is invalid
    error: str | None = None  # llguidance's (or the GBNF converter's) message


class GrammarCache:
    """A thread-safe LRU of compiled constraints; failures are cached too (a retried bad schema is cheap)."""

    def __init__(self, maxsize: int = CACHE_SIZE):
        self.maxsize = maxsize
        self._entries: collections.OrderedDict[bytes, Compiled] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, constraint: Constraint) -> Compiled:
        key = constraint.key()
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
        compiled = compile_constraint(constraint)  # outside the lock: compiling may take a while
        with self._lock:
            self.misses += 1
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._entries)


CACHE = GrammarCache()


def compile_constraint(constraint: Constraint) -> Compiled:
    """The llguidance grammar for one constraint, validated without a tokenizer."""
    try:
        grammar = _to_grammar(constraint)
    except Exception as exc:  # noqa: BLE001 - any failure of a third-party parser on client text is a 400
        return Compiled(None, str(exc) or type(exc).__name__)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        return Compiled(None, messages[0] if messages else "invalid grammar")
    if messages:
        log.debug("%s compiled with warnings: %s", constraint.param, "; ".join(messages))
    return Compiled(grammar)


def _to_grammar(constraint: Constraint) -> str:
    if constraint.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(constraint.source, defaults={"lenient": constraint.lenient})
    if constraint.kind == "regex":
        return LLMatcher.grammar_from_regex(constraint.source)
    if constraint.kind == "gbnf":
        return LLMatcher.grammar_from_lark(gbnf_to_lark(constraint.source))
    return LLMatcher.grammar_from_lark(constraint.source)


# ---------------------------------------------------------------- request -> constraint


def grammar_for(req: SamplingRequest, cache: GrammarCache = CACHE) -> str | None:
    """`SamplingParams.grammar` for a request: None when unconstrained; a 400 naming the field otherwise."""
    found = request_constraints(req)
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(c.param for c in found)
        raise bad_request(f"give at most one output constraint (response_format json_object / json_schema, "
                          f"speculant.regex / grammar, vLLM's structured_outputs or guided_*, llama.cpp's "
                          f"grammar / json_schema); this request has {names}", found[1].param)
    constraint = found[0]
    compiled = cache.get(constraint)
    if compiled.error is not None:
        raise bad_request(f"{_describe(constraint)} is not valid: {shorten_error(compiled.error)}", constraint.param)
    return compiled.grammar


def shorten_error(message: str) -> str:
    """llguidance quotes the offending input; a huge input must not make a huge error body."""
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " [...]"


def _describe(constraint: Constraint) -> str:
    if constraint.kind == "json_schema":
        return f"the {constraint.param} JSON schema"
    if constraint.kind == "regex":
        return constraint.param
    return f"{constraint.param} ({constraint.kind})"


def request_constraints(req: SamplingRequest) -> list[Constraint]:
    """Every output constraint the request asks for (a valid request has at most one)."""
    found = []
    if req.response_format is not None:
        from_format = _response_format(req.response_format)
        if from_format is not None:
            found.append(from_format)
    if req.speculant is not None:
        found.extend(_speculant(req.speculant))
    found.extend(_vllm(req.structured_outputs, "structured_outputs.") if req.structured_outputs else [])
    found.extend(_vllm(StructuredOutputs(json=req.guided_json, regex=req.guided_regex, choice=req.guided_choice,
                                         grammar=req.guided_grammar), "guided_"))
    if req.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported (JSON whitespace follows the grammar "
                          "library's default)", "guided_whitespace_pattern")
    found.extend(_vllm(StructuredOutputs(json=req.json_schema, grammar=req.grammar), "", gbnf_only=True))
    for constraint in found:
        if len(constraint.source) > MAX_CONSTRAINT_CHARS:
            raise bad_request(f"{_describe(constraint)} is too long (at most {MAX_CONSTRAINT_CHARS} characters)",
                              constraint.param)
    return found


def _response_format(rf: ResponseFormat) -> Constraint | None:
    param = "response_format"
    if rf.type == "text":
        return None
    if rf.type == "json_object":
        return Constraint(param, "json_schema", JSON_OBJECT_SCHEMA)
    if rf.type != "json_schema":
        raise bad_request(f"response_format type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}; "
                          f"got {rf.type!r}", param)
    spec = rf.json_schema
    if spec is None or spec.schema is None:
        raise bad_request("response_format type 'json_schema' needs json_schema.schema, "
                          "e.g. {\"type\": \"json_schema\", \"json_schema\": {\"name\": \"answer\", "
                          "\"schema\": {\"type\": \"object\"}}}", param)
    try:
        source = msgspec.json.encode(spec.schema).decode()
    except (RecursionError, msgspec.EncodeError) as exc:
        raise bad_request(f"the response_format JSON schema cannot be encoded: {exc}", param) from None
    return Constraint(param, "json_schema", source, lenient=not spec.strict)


def _speculant(options: SpeculantOptions) -> list[Constraint]:
    found = []
    if options.regex is not None:
        if not options.regex:
            raise bad_request("speculant.regex must not be empty", "speculant.regex")
        found.append(Constraint("speculant.regex", "regex", options.regex))
    if options.grammar is not None:
        if not options.grammar.strip():
            raise bad_request("speculant.grammar must not be empty", "speculant.grammar")
        found.append(Constraint("speculant.grammar", options.grammar_syntax or "lark", options.grammar))
    elif options.grammar_syntax is not None:
        raise bad_request("speculant.grammar_syntax is given without speculant.grammar", "speculant.grammar_syntax")
    return found


def _vllm(so: StructuredOutputs, prefix: str, gbnf_only: bool = False) -> list[Constraint]:
    """vLLM's structured_outputs (prefix "structured_outputs."), its guided_* fields (prefix "guided_") or
    llama.cpp's json_schema and grammar (prefix "", GBNF only), as constraints named by their field."""
    found = []
    if so.json is not None:
        found.append(_json_constraint(so.json, prefix + "json" if prefix else "json_schema"))
    if so.json_object:
        found.append(Constraint(prefix + "json_object", "json_schema", JSON_OBJECT_SCHEMA))
    if so.regex is not None:
        _require_text(so.regex, prefix + "regex")
        found.append(Constraint(prefix + "regex", "regex", so.regex))
    if so.choice is not None:
        param = prefix + "choice"
        if not so.choice or not all(so.choice):
            raise bad_request(f"{param} must be a list of non-empty strings", param)
        found.append(Constraint(param, "regex", "|".join("(" + _regex_literal(c) + ")" for c in so.choice)))
    if so.grammar is not None:
        _require_text(so.grammar, prefix + "grammar")
        found.append(Constraint(prefix + "grammar", "gbnf" if gbnf_only or "::=" in so.grammar else "lark", so.grammar))
    return found


def _json_constraint(schema, param: str) -> Constraint:
    """A JSON schema given as an object or as its JSON text; unenforceable keywords are ignored (not strict)."""
    if isinstance(schema, str):
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise bad_request(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    try:
        return Constraint(param, "json_schema", msgspec.json.encode(schema).decode(), lenient=True)
    except (RecursionError, msgspec.EncodeError) as exc:
        raise bad_request(f"{param} cannot be encoded: {exc}", param) from None


def _require_text(text: str, param: str) -> None:
    if not text.strip():
        raise bad_request(f"{param} must not be empty", param)


_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


def _regex_literal(text: str) -> str:
    """text as a regex (Rust `regex` syntax) that matches exactly it."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)
