"""Tools reach the prompt: a template that renders tools itself gets them (and earlier calls with their
arguments as a mapping); a template that does not (SmolLM2's) gets a system note listing the tools and
the call format, and earlier calls as <tool_call> text."""

from __future__ import annotations

import json

from engine.model import chat_templates
from engine.model.tool_prompt import render_inputs
from engine.serving.protocol import ChatMessage

TOOLS = json.dumps([{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}])
CALL = json.dumps([{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}])
CONVERSATION = [ChatMessage("user", "Weather in Paris?"), ChatMessage("assistant", "", tool_calls_json=CALL),
                ChatMessage("tool", "{\"temp\": 21}", tool_call_id="call_1")]
# A minimal tool-aware template in the style of Qwen 2.5's.
AWARE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
         "{% for m in messages %}{{ m.role }}:{{ m.content }}"
         "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}"
         "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}")


def test_a_template_without_tools_gets_a_system_note(tokenizer):
    messages, context = render_inputs(CONVERSATION, TOOLS, tokenizer.template_source())
    text = tokenizer.apply_chat_template(messages, True, **context)
    assert context == {}
    assert text.startswith("<|im_start|>system\nYou can call functions.") and '"name": "get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "<|im_start|>tool\n{\"temp\": 21}" in text and text.endswith("<|im_start|>assistant\n")


def test_a_tool_aware_template_renders_the_tools_itself():
    messages, context = render_inputs(CONVERSATION, TOOLS, AWARE)
    text = chat_templates.render(AWARE, messages, False, **context)
    assert text.splitlines()[0] == "TOOLS:get_weather;"
    assert '[call get_weather {"city": "Paris"}]' in text and "(for call_1)" in text
    assert "You can call functions" not in text


def test_no_tools_leaves_the_conversation_alone(tokenizer):
    plain = [ChatMessage("user", "hi")]
    messages, context = render_inputs(plain, None, tokenizer.template_source())
    assert context == {} and messages == [{"role": "user", "content": "hi"}]
