"""Chat templates for the chat endpoints: reading --chat-template, the shipped ChatML template that
renders `tools`, checking whether a template renders them at all, and flattening OpenAI content
parts into the text a template reads."""

from __future__ import annotations

import os

from jaxserve.server.openai.protocol import OpenAIError

# The template that renders `tools` for ChatML models such as the default one (hermes tool calls).
CHATML_TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "chat_templates",
                                     "tool_chat_template_chatml_hermes.jinja")


def load_chat_template(value: str | None) -> str | None:
    """--chat-template: a file path, or the template text itself (vLLM reads both)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a jinja template")


_PROBE_TOOL = {"type": "function", "function": {
    "name": "jaxserve_probe_tool", "description": "A tool that only tests the template.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}


def template_renders_tools(tokenizer, template: str) -> bool:
    """Whether a chat template writes a request's `tools` into the prompt: rendered with and
    without a sample tool, the two prompts differ. A template that cannot be rendered here
    counts as rendering them (nothing to warn about with certainty)."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    try:
        with_tool = tokenizer.apply_chat_template(messages, tools=[_PROBE_TOOL],
                                                  chat_template=template)
        without = tokenizer.apply_chat_template(messages, chat_template=template)
    except Exception:
        return True
    return with_tool != without


def _flatten_content(message: dict, index: int) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) -> one string. Other part types
    (images, audio, files) are refused: the model reads text only, and answering as if they were
    absent would be wrong."""
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(400, f"content part type {kind!r} is not supported: this model "
                                       "reads text only (parts of type 'text' with a 'text' "
                                       "string)", param=f"messages.{index}.content.{j}")
            texts.append(part["text"])
        message = {**message, "content": "\n".join(texts)}
    return message
