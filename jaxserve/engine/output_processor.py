"""Turns the scheduler's updated requests into `RequestOutput`s: incremental detokenization, stop
strings, logprobs in vLLM's layout, output kinds (cumulative, delta, final only) and n > 1
fan-in (children `"{i}_{parent_id}"` gathered back under the parent's id).
"""

from __future__ import annotations

import dataclasses

from jaxserve.core.request import Request
from jaxserve.outputs import CompletionOutput, Logprob, RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams
from jaxserve.tokenizer.tokenizer import IncrementalDetokenizer, Tokenizer, check_stop_strings


@dataclasses.dataclass
class _Child:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    text: str = ""
    num_tokens: int = 0             # output tokens seen so far
    sent_text: int = 0              # chars already emitted (DELTA)
    sent_tokens: int = 0            # tokens already emitted (DELTA)
    logprobs: list | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    request: Request | None = None  # the engine's Request, once it has produced output


@dataclasses.dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    kind: RequestOutputKind
    children: list[_Child]
    child_ids: list[str]
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    sent_prompt_logprobs: int = 0   # prompt positions already emitted (DELTA)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, stream_interval: int = 1):
        """stream_interval (vLLM's --stream-interval): a DELTA output is made once one of its
        children has that many tokens not yet sent, its first, or its finish."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._parents: dict[str, _Parent] = {}
        self._child_of: dict[str, tuple[_Parent, _Child]] = {}   # child request id -> both

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, child_ids: list[str],
                    child_params: list[SamplingParams]):
        children = [_Child(i, p, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                        p.skip_special_tokens)
                           if p.detokenize else None,
                           logprobs=[] if p.logprobs is not None else None,
                           cumulative_logprob=0.0 if p.logprobs is not None else None)
                    for i, p in enumerate(child_params)]
        parent = _Parent(request_id, prompt, list(prompt_token_ids), params.output_kind, children,
                         list(child_ids), prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self._parents[request_id] = parent
        for cid, child in zip(child_ids, children):
            self._child_of[cid] = (parent, child)

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_child(self, request_id: str) -> bool:
        """Whether a request id is taken by a live child (n > 1 children are "{i}_{parent}")."""
        return request_id in self._child_of

    def child_ids(self, request_id: str) -> list[str]:
        return list(self._parents[request_id].child_ids) if request_id in self._parents else []

    def _logprob_entry(self, token_id, logprob, rank, top_ids, top_vals) -> dict[int, Logprob]:
        entry = {int(token_id): Logprob(float(logprob), int(rank),
                                        self.tokenizer.decode_token(int(token_id)))}
        for r, (tid, val) in enumerate(zip(top_ids, top_vals), start=1):
            entry.setdefault(int(tid), Logprob(float(val), r, self.tokenizer.decode_token(int(tid))))
        return entry

    def process(self, updated: list[Request], logprobs: dict, prompt_logprobs: dict,
                aborted: list[str] = ()) -> tuple[list[RequestOutput], list[str]]:
        """prompt_logprobs: request id -> [(prompt position, (token, logprob, rank, top ids,
        top logprobs))]. Returns the outputs to deliver and the child ids that a stop string
        finished (the caller must finish them in the scheduler)."""
        stopped, touched = [], {}
        for req in updated:
            if req.request_id not in self._child_of:
                continue
            parent, child = self._child_of[req.request_id]
            child.request = req
            new_ids = req.output_token_ids[child.num_tokens:]
            if req.request_id in prompt_logprobs and parent.prompt_logprobs is not None:
                self._add_prompt_logprobs(parent, prompt_logprobs[req.request_id])
            if new_ids:
                # vLLM: the stop token (EOS or a stop_token_ids entry) that ended the request is
                # kept in token_ids but not in the text, unless include_stop_str_in_output; with
                # skip_special_tokens=False (tool call parsers) EOS would otherwise show as text
                stop_token = req.is_finished() and req.get_finished_reason() == "stop" \
                    and new_ids[-1] in child.params.all_stop_token_ids \
                    and not child.params.include_stop_str_in_output
                new_chars = self._add_tokens(child, new_ids, logprobs.get(req.request_id),
                                             text_ids=new_ids[:-1] if stop_token else new_ids)
                if child.finish_reason is None and child.params.stop:
                    if self._check_stop(child, new_chars):
                        stopped.append(req.request_id)
            if child.finish_reason is None and req.is_finished():
                child.finish_reason = req.get_finished_reason()
                child.stop_reason = req.stop_reason
                if child.detok is not None:
                    child.text += child.detok.flush()
            parent.num_cached_tokens = max(parent.num_cached_tokens, req.num_cached_tokens)
            touched.setdefault(parent.request_id, (parent, []))[1].append(req)
        for cid in aborted:
            if cid in self._child_of:
                parent, child = self._child_of[cid]
                if child.finish_reason is None:
                    child.finish_reason = "abort"
                touched.setdefault(parent.request_id, (parent, []))
        outputs = []
        for parent, reqs in touched.values():
            out = self._make_output(parent, reqs)
            if out is not None:
                outputs.append(out)
        return outputs, stopped

    def _add_prompt_logprobs(self, parent: _Parent, entries) -> None:
        """entries: [(prompt position, (token, logprob, rank, top ids, top logprobs))]. Each
        lands at its position; a position already filled keeps its first entry (a request
        preempted mid-prompt recomputes from position 0 and scores those positions again)."""
        lps = parent.prompt_logprobs
        for pos, (tok, lp, rank, ids, vals) in entries:
            if not 0 < pos < len(parent.prompt_token_ids):
                continue
            while len(lps) < pos:          # never expected: chunks arrive in position order
                lps.append(None)
            if pos == len(lps):
                lps.append(self._logprob_entry(tok, lp, rank, ids, vals))
            elif lps[pos] is None:
                lps[pos] = self._logprob_entry(tok, lp, rank, ids, vals)

    def _add_tokens(self, child: _Child, new_ids: list[int], lps, text_ids: list[int]) -> int:
        """lps: one (logprob, rank, top ids, top logprobs) per sampled token (tokens dropped
        after a stop have none here either). Returns the number of new characters (of
        `text_ids`, the new ids that show as text)."""
        child.num_tokens += len(new_ids)
        delta = child.detok.add_tokens(text_ids) if child.detok is not None and text_ids else ""
        child.text += delta
        if child.logprobs is not None and lps is not None:
            k = child.params.logprobs
            for tok, (logprob, rank, top_ids, top_vals) in zip(new_ids, lps):
                child.logprobs.append(self._logprob_entry(tok, logprob, rank, top_ids[:k],
                                                          top_vals[:k]))
                child.cumulative_logprob += logprob
        return len(delta)

    def _check_stop(self, child: _Child, new_chars: int) -> bool:
        hit = check_stop_strings(child.text, new_chars, child.params.stop,
                                 child.params.include_stop_str_in_output)
        if hit is None:
            return False
        stop_str, cut = hit
        if cut != -1:
            child.text = child.text[:cut]
        child.finish_reason, child.stop_reason = "stop", stop_str
        return True

    def _completion(self, child: _Child, delta: bool) -> CompletionOutput:
        finished = child.finish_reason is not None
        req = child.request
        ids = req.output_token_ids[:child.num_tokens] if req is not None else []
        text = child.text
        end = len(text) if finished else max(child.sent_text,
                                             len(text) - child.params.output_text_buffer_length)
        if delta:
            text_out, token_out = text[child.sent_text:end], ids[child.sent_tokens:]
            lps = child.logprobs[child.sent_tokens:] if child.logprobs is not None else None
            child.sent_text, child.sent_tokens = end, child.sent_tokens + len(token_out)
        else:
            text_out, token_out, lps = text[:end], list(ids), child.logprobs
        return CompletionOutput(child.index, text_out, token_out, child.cumulative_logprob,
                                lps, child.finish_reason, child.stop_reason)

    def _make_output(self, parent: _Parent, reqs: list[Request]) -> RequestOutput | None:
        finished = all(c.finish_reason is not None for c in parent.children)
        kind = parent.kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        moved = [self._child_of[r.request_id][1] for r in reqs if r.request_id in self._child_of]
        if delta and moved and not finished and self.stream_interval > 1:
            moved = [c for c in moved if c.finish_reason is not None or c.sent_tokens == 0
                     or c.num_tokens - c.sent_tokens >= self.stream_interval]
            if not moved:
                return None         # the tokens wait in the children for the next output
        if delta and moved:
            # Stream only the children that moved this step (vLLM's n > 1 delta behaviour);
            # every one of them, so no child's delta or finish is dropped.
            children = sorted(moved, key=lambda c: c.index)
        else:
            children = parent.children
        outs = [self._completion(c, delta) for c in children]
        prompt_lps = self._prompt_logprobs_out(parent, delta)
        if finished:
            self._forget(parent)
        first = parent.children[0].request
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             prompt_lps, outs, finished,
                             metrics=first.metrics() if first is not None else None,
                             num_cached_tokens=max(0, parent.num_cached_tokens))

    @staticmethod
    def _prompt_logprobs_out(parent: _Parent, delta: bool) -> list | None:
        """The prompt logprobs an output carries, always a fresh list (the engine keeps appending
        to its own while later prefill chunks arrive, possibly in another thread than the
        consumer's): DELTA, the positions not emitted yet (None when there are none), so a
        stream delivers every position exactly once; otherwise every position so far."""
        lps = parent.prompt_logprobs
        if lps is None:
            return None
        if not delta:
            return list(lps)
        new, parent.sent_prompt_logprobs = lps[parent.sent_prompt_logprobs:], len(lps)
        return new or None

    def _forget(self, parent: _Parent):
        del self._parents[parent.request_id]
        for cid in parent.child_ids:
            self._child_of.pop(cid, None)
