"""What every tool parser shares: the parsed state of an output, partial-JSON helpers, ids.

A parser reads the whole output text so far (`parse(text, final)`) and says what is certain:
the content outside calls, and for each call its name (once complete) and its arguments (raw JSON
text so far, or the final arguments string once the call is complete). Streaming re-parses the
growing text and sends only what was not sent yet (see streaming.py), so every streamed piece is a
prefix of the non-streamed result by construction: when `final=False` a parser holds back text
that might still turn into a call marker, and argument text is cut to its stable prefix
(`stable_json_prefix`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import string
import uuid

import jiter


@dataclasses.dataclass
class CallState:
    """One tool call as far as the output shows it."""

    name: str | None = None          # set once the whole name has been generated
    args_raw: str = ""               # the raw JSON text of the arguments so far
    arguments: str | None = None     # the final arguments string, once the call is complete
    verbatim: bool = False           # args_raw is streamed as is (a named tool_choice's output)


@dataclasses.dataclass
class ParsedOutput:
    content: str | None              # text outside calls (None: none)
    calls: list[CallState]


class ToolParser:
    """Base class. Subclasses set `name` and implement `parse`."""

    name = ""
    # Markers such as <|python_tag|> or [TOOL_CALLS] are special tokens in their models'
    # vocabularies: the detokenizer must keep them for the parser to see them (vLLM's
    # adjust_request does the same).
    keeps_special_tokens = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def extract(self, text: str) -> ParsedOutput:
        """The non-streaming result: calls only if every one parsed, else all text is content."""
        try:
            out = self.parse(text, final=True)
        except ValueError:
            return ParsedOutput(text, [])
        if not out.calls or any(c.name is None or c.arguments is None for c in out.calls):
            return ParsedOutput(text, [])
        return out

    def new_call_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """Mistral's chat templates accept only 9-character alphanumeric tool call ids."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def dumps(value) -> str:
    """The arguments string of a parsed call (vLLM: json.dumps(..., ensure_ascii=False))."""
    return json.dumps(value, ensure_ascii=False)


def content_or_none(text: str) -> str | None:
    return text if text else None


def held_back(text: str, markers: tuple[str, ...]) -> int:
    """How many trailing chars of `text` might be the start of one of `markers` (a partial marker
    at the end must not be streamed as content)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


def streamable_content(text: str, final: bool, markers: tuple[str, ...]) -> str:
    """Content that is certain while streaming: no partial marker and no trailing whitespace (a
    call may follow; content before calls is right-stripped)."""
    if final:
        return text
    return text[:len(text) - held_back(text, markers)].rstrip()


# A JSON string (its closing quote captured; empty when the text ends inside it) or a bracket.
# Strings are skipped by the regex engine, so scanning long arguments costs little Python.
_JSON_TOKEN = re.compile(r'"(?:[^"\\]+|\\.)*("?)|[{}\[\]]')


def _scan(text: str, start: int) -> tuple[int | None, int, bool]:
    """Scan the container value starting at `start`: (its end index if complete, else None;
    the bracket depth where the text ends; whether it ends inside a string)."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, start):
        c = text[m.start()]
        if c == '"':
            if not m.group(1):
                return None, depth, True
        elif c in "{[":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return m.end(), 0, False
    return None, depth, False


def json_value_end(text: str, start: int = 0) -> int | None:
    """The end index of the complete JSON value starting at `start` (leading whitespace allowed),
    or None if the text ends before the value does. Raises ValueError on text that cannot start
    a JSON value."""
    i, n = start, len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i == n:
        return None
    ch = text[i]
    if ch in "{[":
        return _scan(text, i)[0]
    if ch == '"':
        m = _JSON_TOKEN.match(text, i)
        return m.end() if m.group(1) else None
    m = re.match(r"-?[0-9.eE+-]+|true|false|null", text[i:])
    if not m:
        raise ValueError(f"not a JSON value at {text[i:i + 20]!r}")
    end = i + m.end()
    return end if end < n else None   # a number may go on growing


_OPEN_PRIMITIVE = re.compile(r"(?:-?[0-9.eE+-]+|[a-z]+)\s*$")


def stable_json_prefix(raw: str) -> str:
    """The longest text certain to begin `dumps(value)` of the JSON value whose first chars are
    `raw` (the whole of it once the value is complete; text after the value is ignored).

    An unfinished value is parsed with jiter's partial mode (an unfinished last string kept),
    serialised, and the closers jiter added are dropped (one per open container, one quote for an
    open string). A number or literal still being written is left out: it may grow (`1` -> `12`).
    A value written as a JSON string is sent only once complete (it may be decoded)."""
    start = len(raw) - len(raw.lstrip())
    if start == len(raw) or raw[start] not in "{[":
        return ""
    end, depth, in_str = _scan(raw, start)
    if end is not None:
        return dumps(json.loads(raw[start:end]))
    if not in_str:
        raw = _OPEN_PRIMITIVE.sub("", raw)
    try:
        value = jiter.from_json(raw.encode(), partial_mode="trailing-strings")
    except ValueError:
        return ""
    text = dumps(value)
    # An unfinished key is dropped by jiter although its quote was counted: cutting one char
    # too many still leaves a prefix. Never end on half of a surrogate pair.
    text = text[:len(text) - depth - (1 if in_str else 0)]
    if text and "\ud800" <= text[-1] <= "\udfff":
        text = text[:-1]
    return text


_ARGS_KEY = re.compile(r'"(arguments|parameters)"\s*:\s*')


def json_call(raw: str, final: bool) -> CallState:
    """A call written as one JSON object {"name": ..., "arguments" | "parameters": {...}}
    (Hermes, Llama 3, old Mistral, the `required` array's items). `raw` starts at its `{`."""
    end = json_value_end(raw)
    if end is not None:
        obj = json.loads(raw[:end])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ValueError("a tool call must be a JSON object with a string 'name'")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):       # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                pass
        return CallState(obj["name"], "", dumps(args))
    if final:
        raise ValueError("unfinished tool call")
    state = CallState()
    try:
        head = jiter.from_json(raw.encode(), partial_mode="on")   # unfinished strings dropped
    except ValueError:
        return state
    if isinstance(head, dict) and isinstance(head.get("name"), str):
        state.name = head["name"]
    m = _ARGS_KEY.search(raw)
    if m:
        state.args_raw = raw[m.end():]
    return state


def json_call_array(body: str, final: bool) -> list[CallState]:
    """A JSON array of call objects (`[{...}, {...}]`, old Mistral and tool_choice 'required'),
    possibly unfinished. `body` starts with `[`."""
    calls, pos = [], 1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(body):
            if final:
                raise ValueError("unfinished tool call array")
            return calls
        if body[pos] == "]":
            if final and body[pos + 1:].strip():
                raise ValueError("text after the tool call array")
            return calls
        end = json_value_end(body, pos)
        if end is None:
            calls.append(json_call(body[pos:], final))
            return calls
        calls.append(json_call(body[pos:end], True))
        pos = end
