"""A chat choice's output as message fields: reasoning, content and tool calls.

`ChatOutputParser(reasoning_parser, tool_parser, max_calls)` serves one choice. The reasoning
parser (if any) splits the output first; the tool parser reads only the answer after it.

- `message(text)` -> {"content", "reasoning", "tool_calls"} of the finished output.
- `feed(delta_text, finished)` -> the stream's deltas for the new text: `{"reasoning": ...}`,
  `{"content": ...}`, and for tool calls `{"tool_calls": [{"index", "id", "type", "function":
  {"name", "arguments": ""}}]}` once a call's name is complete, then `{"tool_calls": [{"index",
  "function": {"arguments": suffix}}]}` as its arguments become certain.

Streaming re-parses the whole output so far and sends only what the last parse added, so the
deltas of a well-formed output join to exactly the non-streamed message.

An output cut by the length limit (`cut=True`, finish_reason "length") whose call does not parse
keeps what was produced, as OpenAI does: when a call's name was written, the message is what the
stream had sent as certain (the content before the calls, each begun call with its arguments so
far, unfinished JSON); else all its text is content. Streamed and not, the message is the same.
"""

from __future__ import annotations

import logging

from jaxserve.server.openai.reasoning import ReasoningParser
from jaxserve.server.openai.tool_choice import NamedToolParser, RequiredToolParser
from jaxserve.server.openai.tool_parsers.base import (
    CallState,
    ParsedOutput,
    ToolParser,
    stable_json_prefix,
)

logger = logging.getLogger("jaxserve.server")


def _sure_arguments(call: CallState) -> str:
    if call.arguments is not None:
        return call.arguments
    return call.args_raw if call.verbatim else stable_json_prefix(call.args_raw)


def _cut_output(tools: ToolParser, text: str) -> ParsedOutput:
    """The tool parse of an output the length limit ended (see the module docstring)."""
    parsed = tools.extract(text)             # no calls: all text is content
    if parsed.calls:
        return parsed                        # its calls are complete
    try:
        sure = tools.parse(text, final=False)
    except ValueError:
        return parsed
    begun = [CallState(c.name, "", _sure_arguments(c)) for c in sure.calls if c.name is not None]
    return ParsedOutput(sure.content, begun) if begun else parsed


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 max_calls: int | None = None):
        self.reasoning = reasoning
        self.tools = tools
        self.max_calls = max_calls          # 1 when parallel_tool_calls is false
        self.text = ""
        self._sent_reasoning = ""
        self._sent_content = ""
        self._calls: list[list[str]] = []    # per announced call: [id, arguments sent]

    @classmethod
    def for_request(cls, request, tool_parser: type[ToolParser] | None,
                    reasoning_parser: type[ReasoningParser] | None) -> ChatOutputParser | None:
        """The parsing a chat request's choice needs (the server's parser classes; the request's
        tools and tool_choice); None when its output is plain text."""
        tools = None
        if request.uses_tools:
            if request.named_tool is not None:
                tools = NamedToolParser(request.named_tool)
            elif request.tool_choice == "required":
                tools = RequiredToolParser()
            elif tool_parser is not None:
                tools = tool_parser()
        if tools is None and reasoning_parser is None:
            return None
        return cls(reasoning_parser() if reasoning_parser else None, tools,
                   1 if request.parallel_tool_calls is False else None)

    # -- parsing ------------------------------------------------------------------------------
    def _parse(self, text: str, final: bool, cut: bool = False
               ) -> tuple[str | None, ParsedOutput]:
        reasoning, answer = (self.reasoning.split(text, final) if self.reasoning is not None
                             else (None, text))
        if self.tools is None:
            return reasoning, ParsedOutput(answer, [])
        if answer is None:
            return reasoning, ParsedOutput(None, [])
        if cut:
            parsed = _cut_output(self.tools, answer)
        else:
            parsed = self.tools.extract(answer) if final else self.tools.parse(answer, final)
        return reasoning, ParsedOutput(parsed.content, parsed.calls[:self.max_calls])

    def message(self, text: str, cut: bool = False) -> dict:
        """The finished output's message fields; tool_calls is [] when no call was made. cut:
        the length limit ended the output."""
        reasoning, parsed = self._parse(text, final=True, cut=cut)
        calls = [{"id": self.tools.new_call_id(), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}}
                 for c in parsed.calls]
        return {"content": parsed.content, "reasoning": reasoning, "tool_calls": calls}

    @property
    def tools_called(self) -> bool:
        """Whether the stream announced a tool call."""
        return bool(self._calls)

    # -- streaming ----------------------------------------------------------------------------
    def feed(self, delta_text: str, finished: bool, cut: bool = False) -> list[dict]:
        """cut: the output finished at the length limit."""
        self.text += delta_text
        try:
            reasoning, parsed = self._parse(self.text, final=finished, cut=cut)
        except ValueError:
            return []      # not parseable yet (a malformed call): wait for more text
        deltas = []
        piece = self._advance(reasoning or "", self._sent_reasoning, "reasoning")
        if piece:
            self._sent_reasoning += piece
            deltas.append({"reasoning": piece})
        piece = self._advance(parsed.content or "", self._sent_content, "content")
        if piece:
            self._sent_content += piece
            deltas.append({"content": piece})
        for i, call in enumerate(parsed.calls):
            if i == len(self._calls):
                if call.name is None:
                    break          # calls are announced in order, each once its name is known
                call_id = self.tools.new_call_id()
                self._calls.append([call_id, ""])
                deltas.append({"tool_calls": [{"index": i, "id": call_id, "type": "function",
                                               "function": {"name": call.name,
                                                            "arguments": ""}}]})
            sent = self._calls[i][1]
            piece = self._advance(_sure_arguments(call), sent, f"tool call {i} arguments")
            if piece:
                self._calls[i][1] += piece
                deltas.append({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
        return deltas

    @staticmethod
    def _advance(now: str, sent: str, what: str) -> str:
        """The new text of a field; "" when nothing new. A parse that contradicts what was sent
        (an output that turned out malformed) sends nothing more for that field."""
        if len(now) <= len(sent):
            return ""
        if not now.startswith(sent):
            logger.warning("streamed %s no longer match the output; not extending them", what)
            return ""
        return now[len(sent):]


def finish_reason_for(request, reason: str | None, tools_called: bool) -> str | None:
    """vLLM: a choice whose output became tool calls ends with "tool_calls" instead of "stop" (a
    named tool_choice keeps "stop", as OpenAI answers). "length" stays: the output was cut."""
    if reason == "stop" and tools_called and request.named_tool is None:
        return "tool_calls"
    return reason


def with_reasoning_content(delta: dict) -> dict:
    """vLLM now names the field `reasoning`; older clients read `reasoning_content`."""
    if "reasoning" in delta:
        return {**delta, "reasoning_content": delta["reasoning"]}
    return delta
