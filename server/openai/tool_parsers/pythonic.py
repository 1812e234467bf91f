"""`pythonic`: a Python list of calls with keyword arguments (Llama 3.2 / 4, ToolACE, ...):

    [get_weather(city="Paris", unit="celsius"), get_time(tz="Europe/Paris")]

optionally inside `<|python_start|>` ... `<|python_end|>`. Argument values are Python literals
(strings, numbers, True/False/None, lists, dicts) and become JSON. An output that is not such a
list is plain content. While streaming, a call's name is sent when its `(` appears and its
arguments in one piece when its `)` does.
"""

from __future__ import annotations

import ast
import re

from jaxserve.server.openai.tool_parsers.base import CallState, ParsedOutput, ToolParser, dumps

START, END = "<|python_start|>", "<|python_end|>"
_HEAD = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_PARTIAL_NAME = re.compile(r"[A-Za-z_][\w.]*\s*")


def _literal(node: ast.AST):
    if isinstance(node, ast.Name) and node.id in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[node.id]   # JSON spellings
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    return ast.literal_eval(node)


def _expr(text: str) -> ast.AST:
    try:
        return ast.parse(text, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"not Python call syntax: {e.msg}") from None


def _call(node: ast.AST) -> CallState:
    if not isinstance(node, ast.Call) or node.args:
        raise ValueError("each tool call must be name(keyword=value, ...)")
    name = ast.unparse(node.func)
    args = {kw.arg: _literal(kw.value) for kw in node.keywords}
    if None in args:
        raise ValueError("**kwargs in a tool call")
    return CallState(name, "", dumps(args))


def _scan_calls(body: str) -> tuple[list[tuple[int, int | None]], bool]:
    """(start, end or None) of each call at depth 1 of the list `body` (which starts with `[`),
    and whether the list is closed."""
    spans, depth, quote, esc, start = [], 0, None, False, None
    for i, c in enumerate(body):
        if quote:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 1 and c == ")" and start is not None:
                spans.append((start, i + 1))
                start = None
            if depth == 0:
                return spans, True
        elif depth == 1 and start is None and not c.isspace() and c != ",":
            start = i
    if start is not None:
        spans.append((start, None))
    return spans, False


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        body = text.strip()
        if body.startswith(START):
            body = body[len(START):]
            body = body[:body.rindex(END)] if END in body else body
            body = body.strip()
        elif not final and START.startswith(body) and body:
            return ParsedOutput(None, [])
        if not body.startswith("["):
            return ParsedOutput(text if (final or body) else None, [])
        if final:
            tree = _expr(body)
            if not isinstance(tree, ast.List):
                raise ValueError("not a list of calls")
            return ParsedOutput(None, [_call(e) for e in tree.elts])
        calls = []
        for start, end in _scan_calls(body)[0]:
            head = _HEAD.match(body, start)
            if end is not None:
                calls.append(_call(_expr(body[start:end].strip())))
            elif head:
                calls.append(CallState(head.group(1)))
            elif _PARTIAL_NAME.fullmatch(body[start:]):
                calls.append(CallState())
            else:
                return ParsedOutput(text, [])     # "[1] ..." and the like: plain content
        return ParsedOutput(None, calls)
