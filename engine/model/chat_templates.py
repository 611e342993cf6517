"""Chat templates: the Jinja sandbox they render in, and defaults for files that carry none.

A GGUF usually holds its chat template (`tokenizer.chat_template`); when it does not, the
vocabulary tells the format: Gemma's turn markers (`<start_of_turn>`) or else ChatML.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

# A ChatML template for files that carry none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Gemma's turn format, for Gemma files without a template: the assistant is "model", a system
# message has no turn of its own but opens the first user turn, contents are trimmed, and the
# roles must alternate user / model: the format of Gemma 3's own template and of llama.cpp's
# built-in `gemma` one (which also trims the system message, as here).
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set first = messages[0] if messages else none %}"
    "{% if first is not none and first['role'] == 'system' %}"
    "{% set prefix = first['content'] | trim + '\\n\\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 is even) %}"
    "{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with the user') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def default_template(tokens: Sequence[str]) -> str:
    """The template for a vocabulary whose file carries none."""
    return GEMMA_TEMPLATE if "<start_of_turn>" in tokens and "<end_of_turn>" in tokens else CHATML_TEMPLATE


def render(source: str, messages: Sequence[Any], add_generation_prompt: bool, continue_final_message: bool = False,
           **context: Any) -> str:
    """The conversation as prompt text; continue_final_message: cut after the final message's text (open_final)."""
    template = compile_template(source)
    normalized = normalize_messages(messages)
    try:
        text = template.render(messages=normalized, add_generation_prompt=add_generation_prompt, **context)
    except jinja2.TemplateError as exc:
        raise ValueError(f"messages: the chat template rejected the conversation: {exc}") from exc
    return open_final(text, normalized[-1]["content"]) if continue_final_message else text


def open_final(text: str, final: str) -> str:
    """The rendered chat `text` ended right after the final message's content `final`, so that the model
    continues that message (vLLM's continue_final_message: a prefilled start of the answer). Templates often
    trim a message, so its stripped content is looked for, last occurrence; the message's trailing whitespace
    stays where the template kept it."""
    core = final.strip()
    at = text.rfind(core) if core else -1
    if at < 0:
        raise ValueError("messages: continue_final_message needs a final message with text that the chat "
                         "template renders unchanged")
    whole = final.lstrip()  # the content as written, trailing whitespace included
    return text[: at + (len(whole) if text.startswith(whole, at) else len(core))]


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """Plain dicts with string roles and contents (OpenAI text parts joined)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError("messages: expected a non-empty list of {role, content} messages")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            message = {name: getattr(message, name) for name in ("role", "content", "name") if hasattr(message, name)}
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role: expected a string")
        if content is None:
            content = ""
        elif isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: expected a string or a list of text parts")
        result.append({k: v for k, v in dict(message, role=role, content=content).items() if v is not None})
    return result


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Same environment settings as transformers, so templates render byte-identically."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: invalid Jinja template: {exc}") from exc
