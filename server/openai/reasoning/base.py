"""The shared `<think>` / `</think>` splitting; subclasses choose what text without a start tag
means."""

from __future__ import annotations

from jaxserve.server.openai.tool_parsers.base import held_back


class ReasoningParser:
    name = ""
    start, end = "<think>", "</think>"
    # True: the output may begin inside the reasoning because the chat template already wrote
    # the start tag (DeepSeek-R1): everything before the end tag is reasoning.
    implicit_start = False

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) of the output so far; None where a part is empty."""
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start):]
        elif not final and head and self.start.startswith(head):
            return None, None                # maybe the start tag: wait
        elif self.implicit_start:
            body = text
        else:
            return None, text or None
        k = body.find(self.end)
        if k < 0:
            if not final:
                body = body[:len(body) - held_back(body, (self.end,))]
            return body or None, None
        return body[:k] or None, body[k + len(self.end):] or None
