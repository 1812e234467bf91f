"""JSONL plumbing for `jaxserve run-batch`: the lazy line reader, the flushed writer, output lines
in OpenAI's Batch format, and the resume scan that repairs a torn last line.

Host side, no jax, no engine: `batch.py` drives the engine; this file only knows about lines.

Output line (one per input line, OpenAI's Batch output shape):

    {"id": "batch_req_<hex>", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "...", "body": {...completion...}},
     "error": null}

A failed request keeps that shape with the HTTP status the server would have answered (400
validation, 404 unknown model, 500 internal) and the server's error body
`{"error": {"message", "type", "param", "code"}}`; the top-level `error` stays null as in
OpenAI's output, where it is reserved for failures that never got an HTTP answer. A line that is
not JSON or has no string custom_id gets `"custom_id": null`.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import IO

# error.code of the line written for a repeated custom_id; resume counts these separately.
DUPLICATE_CODE = "duplicate_custom_id"


def error_body(message: str, type_: str = "BadRequestError", param: str | None = None,
               code: int | str | None = None) -> dict:
    """The server's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def output_line(custom_id: str | None, status_code: int, body: dict,
                request_id: str | None = None) -> dict:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status_code,
                         "request_id": request_id or f"req_{uuid.uuid4().hex}",
                         "body": body},
            "error": None}


def is_success(line: dict) -> bool:
    resp = line.get("response")
    return line.get("error") is None and isinstance(resp, dict) and resp.get("status_code") == 200


# -- input ----------------------------------------------------------------------------------------
def open_input(path: str) -> IO[str]:
    """`-` is stdin. Lines are read one at a time; the file is never read whole."""
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


def count_lines(path: str) -> int | None:
    """Non-blank lines of a regular file, in 1 MiB chunks (for the progress bar's total);
    None for stdin or pipes."""
    if path == "-" or not os.path.isfile(path):
        return None
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")


def non_blank(lines) -> Iterator[tuple[int, str]]:
    """(1-based line number, stripped text) of each non-blank line, lazily."""
    for lineno, text in enumerate(lines, 1):
        text = text.strip()
        if text:
            yield lineno, text


# -- output ---------------------------------------------------------------------------------------
class JsonlWriter:
    """Writes one JSON object per line and flushes it at once, so a killed job keeps every line
    written before the kill."""

    def __init__(self, stream: IO[str], close: bool):
        self.stream, self._close = stream, close

    @classmethod
    def open(cls, path: str, append: bool) -> JsonlWriter:
        if path == "-":
            return cls(sys.stdout, close=False)
        return cls(open(path, "a" if append else "w", encoding="utf-8"), close=True)

    def write(self, obj: dict) -> None:
        self.stream.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._close:
            self.stream.close()
        else:
            self.stream.flush()


@dataclasses.dataclass
class ResumeState:
    """What an earlier run already wrote: the custom_ids answered, how many duplicate-id lines per
    id and how many id-less error lines (both are written at read time, in input order, so a count
    says exactly which input lines they answered), and how many of those lines failed."""

    done: set = dataclasses.field(default_factory=set)
    duplicates: Counter = dataclasses.field(default_factory=Counter)
    anonymous: int = 0
    lines: int = 0
    failed: int = 0
    truncated_bytes: int = 0


def repair_and_scan(path: str) -> ResumeState:
    """Truncate a torn last line (no newline at the end, or not JSON) away and collect what the
    file already answers. A missing file is an empty state."""
    state = ResumeState()
    if path == "-" or not os.path.exists(path):
        return state
    with open(path, "rb+") as f:
        size = f.seek(0, os.SEEK_END)
        good_end = 0           # byte offset after the last complete, parseable line
        f.seek(0)
        offset = 0
        for raw in f:
            offset += len(raw)
            if not raw.endswith(b"\n"):
                break          # torn: the writer was killed mid-line
            try:
                obj = json.loads(raw)
            except ValueError:
                break          # a garbled line can only be the last one written; drop the rest
            good_end = offset
            _record(state, obj)
        if good_end < size:
            f.truncate(good_end)
            state.truncated_bytes = size - good_end
    return state


def _record(state: ResumeState, obj: dict) -> None:
    state.lines += 1
    if not is_success(obj):
        state.failed += 1
    cid = obj.get("custom_id")
    if not isinstance(cid, str):
        state.anonymous += 1
        return
    body = ((obj.get("response") or {}).get("body") or {})
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("code") == DUPLICATE_CODE:
        state.duplicates[cid] += 1
    else:
        state.done.add(cid)
