"""Rendering a chat conversation (with tools, tool calls and tool results) into the prompt's token ids."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvhandoff.errors import ConfigError

#: the chat template of a tokenizer that has none: ChatML, and for tools the Hermes layout of Qwen2.5's own template
#: (tools in the system turn, <tool_call> blocks in assistant turns, <tool_response> blocks in one user turn per run
#: of tool results). Unlike Qwen's, it adds no system line of its own, so a conversation without tools renders as
#: plain ChatML does.
DEFAULT_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within'"
    " + ' <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>,'"
    " + ' \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}"
    "{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- set call = tool_call['function'] if tool_call['function'] is defined else tool_call %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' }}"
    "{{- call['arguments'] | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _arguments(text: Any) -> Any:
    """An assistant tool call's arguments as templates want them: the JSON object the string holds (templates
    `tojson` it, or iterate its items), else the value unchanged."""
    if not isinstance(text, str):
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """OpenAI-shaped (already validated) message dicts → what chat templates expect: developer → system, content
    None → "", assistant tool calls' JSON `arguments` parsed to a dict (an invalid one stays a string), tool
    messages with their `tool_call_id` and `name` when given. Applying it twice changes nothing."""
    converted = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        content = message.get("content")
        item: dict[str, Any] = {"role": role, "content": "" if content is None else content}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = [
                {"id": call.get("id"), "type": call.get("type", "function"),
                 "function": {"name": call["function"]["name"],
                              "arguments": _arguments(call["function"].get("arguments"))}}
                for call in message["tool_calls"]
            ]
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if message.get(key) is not None:
                    item[key] = message[key]
        converted.append(item)
    return converted


def chat_template_of(tokenizer) -> str:
    """The chat template ``tokenizer`` renders with: its own, or `DEFAULT_CHAT_TEMPLATE` when it has none."""
    return getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def render(tokenizer, messages: Sequence[dict], tools: Sequence[Any] | None = None,
           add_generation_prompt: bool = True, template: str | None = None) -> list[int]:
    """The prompt's token ids: `messages` (OpenAI-shaped; converted by `template_messages`) rendered by `template`
    (None: `chat_template_of(tokenizer)`), with the generation prompt (unless `add_generation_prompt` is False);
    `tools` the OpenAI tool dicts ({"type": "function", "function": {...}}, or objects with `to_dict()`). The
    template's text is tokenized without adding special tokens again (it writes them itself)."""
    text = render_text(tokenizer, messages, tools, add_generation_prompt, template)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_text(tokenizer, messages: Sequence[dict], tools: Sequence[Any] | None = None,
                add_generation_prompt: bool = True, template: str | None = None) -> str:
    """The prompt's text as `render` tokenizes it."""
    template = template or chat_template_of(tokenizer)
    tool_dicts = [tool.to_dict() if hasattr(tool, "to_dict") else tool for tool in tools] if tools else None
    try:
        return tokenizer.apply_chat_template(template_messages(messages), tools=tool_dicts, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # the template refuses this conversation (role order, a missing field, ...)
        raise ConfigError(f"the chat template cannot render these messages: {exc}") from exc
