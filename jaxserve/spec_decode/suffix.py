"""Suffix decoding (Arctic Inference's idea, simple version): a suffix trie over the request's
tokens (prompt and output) and, optionally, over earlier requests' outputs, each node counting
how often its path occurred. To propose, find the longest recent context (up to `max_depth`
tokens) that is a path in the trie and follow the most frequent child, `k` times.

The trie stores every substring of length <= max_depth + k that starts at each position, so
memory is O(num_tokens * depth); requests are short-lived, and the global trie of earlier
outputs is capped at `max_cached_requests` requests."""

from __future__ import annotations

from collections import deque


class _Node(dict):
    __slots__ = ("count",)

    def __init__(self):
        super().__init__()
        self.count = 0


class SuffixTrie:
    def __init__(self, depth: int):
        self.depth = depth
        self.root = _Node()
        self.tokens: list[int] = []

    def extend(self, new_tokens) -> None:
        """Append tokens; every suffix window ending at a new token is counted once."""
        for tok in new_tokens:
            self.tokens.append(int(tok))
            end = len(self.tokens)
            # The windows [start, end) of length <= depth that now end at `end`; each adds its
            # last token as one more occurrence under its prefix path.
            for start in range(max(0, end - self.depth), end):
                node = self.root
                for t in self.tokens[start:end - 1]:
                    node = node.get(t)
                    if node is None:
                        break
                if node is None:
                    continue
                child = node.get(self.tokens[end - 1])
                if child is None:
                    child = node[self.tokens[end - 1]] = _Node()
                child.count += 1

    def match(self, context: list[int]) -> _Node | None:
        """The node of the longest suffix of `context` that is a path (None: no match)."""
        for start in range(max(0, len(context) - self.depth + 1), len(context)):
            node = self.root
            for t in context[start:]:
                node = node.get(t)
                if node is None:
                    break
            if node is not None and node:
                return node
        return None


def _walk(tries: list[SuffixTrie], context: list[int], k: int, min_count: int) -> list[int]:
    out: list[int] = []
    ctx = list(context)
    for _ in range(k):
        best, best_count = None, 0
        for trie in tries:
            node = trie.match(ctx[-(trie.depth - 1):] if trie.depth > 1 else [])
            if node is None:
                continue
            tok, child = max(node.items(), key=lambda kv: kv[1].count)
            if child.count > best_count:
                best, best_count = tok, child.count
        if best is None or best_count < min_count:
            break
        out.append(best)
        ctx.append(best)
    return out


class SuffixProposer:
    """Per-request suffix tries plus a shared trie over the outputs of finished requests."""

    def __init__(self, k: int, max_depth: int = 16, min_count: int = 1,
                 max_cached_requests: int = 0):
        self.k, self.depth, self.min_count = k, max_depth + 1, min_count
        self.max_cached = max_cached_requests
        self.tries: dict[str, SuffixTrie] = {}
        self.global_trie = SuffixTrie(self.depth) if max_cached_requests else None
        self._cached: deque[list[int]] = deque()

    def propose(self, request_id: str, tokens: list[int]) -> list[int]:
        trie = self.tries.get(request_id)
        if trie is None:
            trie = self.tries[request_id] = SuffixTrie(self.depth)
        if len(tokens) < len(trie.tokens):     # never expected (tokens only grow)
            trie = self.tries[request_id] = SuffixTrie(self.depth)
        trie.extend(tokens[len(trie.tokens):])
        tries = [trie] + ([self.global_trie] if self.global_trie is not None else [])
        return _walk(tries, tokens[-(self.depth - 1):], self.k, self.min_count)

    def finish(self, request_id: str, output_tokens: list[int] | None = None) -> None:
        self.tries.pop(request_id, None)
        if self.global_trie is None or not output_tokens:
            return
        self._cached.append(list(output_tokens))
        if len(self._cached) > self.max_cached:
            self._cached.popleft()
            self.global_trie = SuffixTrie(self.depth)      # rebuild without the oldest
            for toks in self._cached:
                self.global_trie.extend(toks)
        else:
            self.global_trie.extend(output_tokens)
