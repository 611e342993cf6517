"""Prompt sets for `speculant bench spec`: the built-in suite and the user's own JSONL files.

The built-in suite lives in `benchmarks/prompt_suite/<category>.jsonl`, in the same format that
`--prompts FILE.jsonl` accepts, one JSON object per line:

    {"category": "code_edit", "prompt": "..."}                      # one user turn
    {"category": "agent_json", "messages": [{"role": ..., "content": ...}, ...]}

with an optional "id" and an optional OpenAI "response_format" (`json_object` or `json_schema`):
such a prompt is decoded under that constraint (an llguidance grammar), as the gateway would. Categories are free-form for user files; the built-in ones are chosen to
span how much of the answer a model-free proposer can copy:

- code_edit: code given in the prompt, asked to rename or modify it (most output is a copy);
- extraction: fields or a summary pulled out of a given passage (partly copied);
- open_chat: open questions (little to copy: speculation must not slow these down);
- agent_json: tool calls / records in one JSON shape that repeats within and across requests
  (what a cross-request cache such as suffix decoding is for).

Two more run only when named (`--categories long_code,long_chat`): ~1,400-token prompts, where a verify's
attention and a draft head's catch-up on the prompt weigh more than in the short suite:

- long_code: a whole Python module to rename things in or comment (mostly copied);
- long_chat: a long document (this project's README, its measurement journal) and a question about it.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from engine.serving.protocol import ChatMessage

SUITE_DIR = pathlib.Path(__file__).resolve().parent / "prompt_suite"
BUILTIN_CATEGORIES = ("code_edit", "extraction", "open_chat", "agent_json")
LONG_CATEGORIES = ("long_code", "long_chat")  # built in, run only when named
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    category: str
    prompt_id: str
    messages: tuple[ChatMessage, ...]
    grammar: str | None = None  # llguidance grammar of the prompt's response_format, if any


def builtin_prompts(categories: list[str] | None = None) -> list[BenchPrompt]:
    """The built-in suite, in category order; `categories` picks a subset, the long ones included (unknown names
    fail)."""
    names = list(BUILTIN_CATEGORIES) if categories is None else categories
    for name in names:
        if name not in BUILTIN_CATEGORIES + LONG_CATEGORIES:
            raise ValueError(f"categories: {name!r} is not a built-in category "
                             f"({', '.join(BUILTIN_CATEGORIES + LONG_CATEGORIES)})")
    prompts: list[BenchPrompt] = []
    for name in names:
        prompts += load_prompts(SUITE_DIR / f"{name}.jsonl")
    return prompts


def load_prompts(path: str | pathlib.Path) -> list[BenchPrompt]:
    """Parse a JSONL prompt file; a bad line is a ValueError naming the file, line and field."""
    path = pathlib.Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"prompts: cannot read {path} ({exc.strerror})") from None
    prompts = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path.name}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"prompts: {where}: invalid JSON ({exc.msg})") from None
        prompts.append(parse_record(record, where, default_id=f"{path.stem}-{lineno}"))
    if not prompts:
        raise ValueError(f"prompts: {path} holds no prompts")
    return prompts


def parse_record(record, where: str, default_id: str) -> BenchPrompt:
    if not isinstance(record, dict):
        raise ValueError(f"prompts: {where}: expected a JSON object")
    category = record.get("category")
    if not isinstance(category, str) or not category.strip():
        raise ValueError(f"prompts: {where}: category: must be a non-empty string")
    prompt_id = record.get("id", default_id)
    if not isinstance(prompt_id, str) or not prompt_id:
        raise ValueError(f"prompts: {where}: id: must be a non-empty string")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        raise ValueError(f"prompts: {where}: prompt: give exactly one of 'prompt' or 'messages'")
    grammar = response_format_grammar(record.get("response_format"), where)
    if has_prompt:
        text = record["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"prompts: {where}: prompt: must be a non-empty string")
        return BenchPrompt(category, prompt_id, (ChatMessage("user", text),), grammar)
    return BenchPrompt(category, prompt_id, parse_messages(record["messages"], where), grammar)


def response_format_grammar(fmt, where: str) -> str | None:
    """The llguidance grammar of an OpenAI response_format (None: unconstrained)."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    import llguidance

    if fmt == {"type": "json_object"}:
        schema = {"type": "object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("json_schema"), dict) \
            and isinstance(fmt["json_schema"].get("schema"), dict):
        schema = fmt["json_schema"]["schema"]
    else:
        raise ValueError(f"prompts: {where}: response_format: expected json_object or json_schema with a schema")
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"prompts: {where}: response_format: {error}")
    return grammar


def parse_messages(messages, where: str) -> tuple[ChatMessage, ...]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"prompts: {where}: messages: must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"prompts: {where}: {field}: must be an object with role and content")
        if m.get("role") not in ROLES:
            raise ValueError(f"prompts: {where}: {field}.role: must be one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"prompts: {where}: {field}.content: must be a string")
        out.append(ChatMessage(m["role"], m["content"]))
    return tuple(out)


def select(prompts: list[BenchPrompt], categories: list[str] | None,
           per_category: int | None = None) -> list[BenchPrompt]:
    """Keep the named categories (in the given order) and at most `per_category` prompts of each."""
    present = list(dict.fromkeys(p.category for p in prompts))
    names = present if categories is None else categories
    for name in names:
        if name not in present:
            raise ValueError(f"categories: {name!r} has no prompts (have: {', '.join(present)})")
    out = []
    for name in names:
        chosen = [p for p in prompts if p.category == name]
        out += chosen if per_category is None else chosen[:per_category]
    return out


def by_category(prompts: list[BenchPrompt]) -> dict[str, list[BenchPrompt]]:
    groups: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    return groups
