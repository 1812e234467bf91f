"""Prompt logprobs kept beside the prefix cache's KV blocks, so scoring requests (lm-eval's
`echo` + `logprobs`, `prompt_logprobs`) can take prefix-cache hits too.

Host side, no jax. Block j of a request holds positions [j*B, (j+1)*B). Its ENTRIES are the
prompt logprobs of the B targets at positions j*B+1 .. (j+1)*B: each is read from the logits one
position earlier, all inside block j, so they depend only on the prefix that block j's chained
hash names plus the one token after the block (the last target). They are therefore keyed by
(block hash, next token). A request whose prefix-cache hit ends after block h-1 gets positions
1 .. h*B from here (position h*B included: the boundary needs no recompute) and computes from
h*B on, scoring targets from h*B+1.

An entry list holds the top `k` logprobs the request that computed it asked for and serves any
request asking k' <= k. It lives exactly as long as its block hash is registered in the block
pool or held by the host KV tier: `drop` is their eviction hook (`KVCacheManager._evicted`).

Entries that a step is computing (a scoring row that completes a block's targets) are "in
flight" until that step's results are recorded (`settle`): a request admitted in the same step,
or, with async scheduling, in the next one (scheduled while the step still runs), may count them
as hits, and picks them up with its own step's results (`record` runs before `take`).
"""

from __future__ import annotations

from collections.abc import Callable

# (target token, logprob, rank, top ids [k], top logprobs [k]): the runner's prompt-logprob entry.
Entry = tuple


class PromptLogprobCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # block hash -> next token -> (k, B entries)
        self._entries: dict[int, dict[int, tuple[int, list[Entry]]]] = {}
        # step -> (block hash, next token) -> largest k a row of that step computes
        self._in_flight: dict[int, dict[tuple[int, int], int]] = {}
        self._step = 0
        # request id -> (position of its first entry, entries of its blocks not stored yet)
        self._pending: dict[str, tuple[int, list[Entry]]] = {}

    def __len__(self) -> int:
        """Block entry lists stored (for tests and stats)."""
        return sum(len(v) for v in self._entries.values())

    # --- lookups ------------------------------------------------------------------------------

    def covers(self, block_hash: int, next_token: int, k: int) -> bool:
        """Whether block entries with at least k top logprobs are stored or being computed."""
        stored = self._entries.get(block_hash, {}).get(next_token)
        if stored is not None and stored[0] >= k:
            return True
        key = (block_hash, next_token)
        return any(step.get(key, -1) >= k for step in self._in_flight.values())

    def get(self, block_hash: int, next_token: int, k: int) -> list[Entry] | None:
        stored = self._entries.get(block_hash, {}).get(next_token)
        if stored is None or stored[0] < k:
            return None
        return [(t, lp, rank, ids[:k], vals[:k]) for t, lp, rank, ids, vals in stored[1]]

    # --- the step -----------------------------------------------------------------------------

    def promise(self, block_hash: int, next_token: int, k: int) -> None:
        """The step being scheduled computes this block's entries with k top logprobs."""
        key, step = (block_hash, next_token), self._in_flight.setdefault(self._step, {})
        step[key] = max(k, step.get(key, -1))

    def new_step(self) -> int:
        """A step is being scheduled: returns its id, for `settle`."""
        self._step += 1
        return self._step

    def settle(self, step: int) -> None:
        """The step's results are recorded (or it failed): its promises end."""
        self._in_flight.pop(step, None)

    def record(self, request_id: str, entries: list[tuple[int, Entry]], block_hashes: list[int],
               token_ids: list[int], num_prompt_tokens: int, k: int,
               is_registered: Callable[[int], bool]) -> None:
        """Take one chunk's computed entries [(position, entry)] (in position order, as the
        runner scores them) and store every block whose B targets are now all known prompt
        tokens and whose hash is still registered. A request's first chunk starts at a block
        boundary (hits are whole blocks), so its entries start at a block's first target."""
        if not entries:
            return
        B = self.block_size
        start, pending = self._pending.get(request_id, (entries[0][0], []))
        if entries[0][0] != start + len(pending):
            if (entries[0][0] - 1) % B:
                self._pending.pop(request_id, None)     # not at a block's first target: skip
                return
            start, pending = entries[0][0], []
        pending = pending + [_copy(e) for _, e in entries]
        while len(pending) >= B:
            j = (start - 1) // B
            if (j + 1) * B < num_prompt_tokens and j < len(block_hashes) \
                    and is_registered(block_hashes[j]):
                per_hash = self._entries.setdefault(block_hashes[j], {})
                nxt = token_ids[(j + 1) * B]
                if per_hash.get(nxt, (-1,))[0] < k:
                    per_hash[nxt] = (k, pending[:B])
            start, pending = start + B, pending[B:]
        self._pending[request_id] = (start, pending)

    def forget(self, request_id: str) -> None:
        """The request is gone (finished, preempted): its incomplete block entries go with it."""
        self._pending.pop(request_id, None)

    # --- eviction -----------------------------------------------------------------------------

    def drop(self, block_hash: int) -> None:
        """The pool evicted (or unregistered) this hash: its entries and promises go."""
        self._entries.pop(block_hash, None)
        for step in self._in_flight.values():
            for key in [key for key in step if key[0] == block_hash]:
                del step[key]

    def clear(self) -> None:
        self._entries.clear()
        self._in_flight.clear()


def _copy(entry: Entry) -> Entry:
    """Plain Python values: the runner's top-k rows are views into a whole step's array, which
    a stored view would keep alive."""
    t, lp, rank, ids, vals = entry
    return int(t), float(lp), int(rank), tuple(int(x) for x in ids), tuple(float(x) for x in vals)
