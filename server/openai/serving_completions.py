"""`/v1/completions`: turning a completion request's prompt (text, token ids, or lists of either)
into checked prompts, queueing them, and its answer as one JSON body or as SSE chunks (echo,
logprobs, prompt logprobs, usage)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

from jaxserve.engine.async_llm import EngineDeadError
from jaxserve.outputs import CompletionOutput
from jaxserve.server.openai.logprobs import completion_logprobs, prompt_logprobs_json
from jaxserve.server.openai.protocol import CompletionRequest, OpenAIError, usage
from jaxserve.server.openai.serving_base import OpenAIServingBase, _input_size, _Prompt, random_id
from jaxserve.server.openai.sse import SSE_DONE, SSEStream, sse
from jaxserve.server.openai.streams import check_not_failed, collect_all, merge_streams


class CompletionServing(OpenAIServingBase):
    """The /v1/completions endpoint (`create_completion`)."""

    def _completion_prompts(self, request: CompletionRequest) -> list[_Prompt]:
        p = request.prompt
        tok = self.engine.tokenizer
        add_special = True if request.add_special_tokens is None else request.add_special_tokens
        if isinstance(p, str):
            raw = [p]
        elif not p:
            raw = [[]]
        elif isinstance(p[0], int):
            raw = [list(p)]
        else:
            raw = list(p)
        prompts = []
        for item in raw:
            if isinstance(item, str):
                prompts.append(_Prompt(item, tok.encode(item, add_special_tokens=add_special)
                                       if item else []))
            else:
                prompts.append(_Prompt(None, list(item)))
        k = self._truncation(request.truncate_prompt_tokens, request.max_tokens)
        if k is not None:
            for pr in prompts:
                if len(pr.token_ids) > k:
                    pr.token_ids, pr.text = pr.token_ids[-k:], None
        return prompts

    def _prepare_completion(self, request: CompletionRequest) -> tuple[list[_Prompt], list[int]]:
        """Tokenize and check the prompts; returns them and each one's room left in the
        context. The CPU-heavy part of a completion request (run off the loop when large)."""
        prompts = self._completion_prompts(request)
        rooms = [self._check_prompt(pr.token_ids, request.max_tokens) for pr in prompts]
        for pr in prompts:
            if pr.text is None and request.echo:
                pr.text = self.engine.tokenizer.decode(pr.token_ids, skip_special_tokens=False)
        return prompts, rooms

    async def create_completion(self, request: CompletionRequest,
                                request_id: str | None = None) -> dict | SSEStream:
        model = self.check_model(request.model)
        self._check_logprobs(request.logprobs, "logprobs")
        self._check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if request.best_of is not None and request.best_of != request.n:
            raise OpenAIError(400, "best_of different from n is not supported", param="best_of")
        prompts, rooms = await self._off_loop(_input_size(request.prompt),
                                              self._prepare_completion, request)
        params = [self._params(request.to_sampling_params, room) for room in rooms]
        base_id = request_id or request.request_id or random_id("cmpl")
        streams = await self._add_all(base_id, prompts, params, request.priority, model)
        created = int(time.time())
        if request.stream:
            usage_out: dict = {}
            return SSEStream(self._completion_stream(request, model, base_id, created, prompts,
                                                     streams, usage_out), usage_out, streams)
        finals = await collect_all(streams)
        return self._completion_response(request, model, base_id, created, prompts, finals)

    def _completion_response(self, request, model, rid, created, prompts, finals) -> dict:
        tok = self.engine.tokenizer
        choices, prompt_tokens, completion_tokens, cached = [], 0, 0, 0
        n = request.n
        for i, (pr, out) in enumerate(zip(prompts, finals)):
            prompt_tokens += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            for c in out.outputs:
                c = _echo_only(c) if request.echo_only else c
                completion_tokens += len(c.token_ids)
                text, lp = c.text, None
                if request.echo:
                    text = (pr.text or "") + c.text
                if request.logprobs is not None:
                    ids, steps = list(c.token_ids), list(c.logprobs or [])
                    if request.echo:
                        ids = list(out.prompt_token_ids) + ids
                        steps = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids)) \
                            + steps
                    lp = completion_logprobs(tok, ids, steps, 0)
                choice = {"index": i * n + c.index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached)}

    async def _completion_stream(self, request, model, rid, created, prompts, streams,
                                 usage_out: dict | None = None) -> AsyncIterator[str]:
        tok = self.engine.tokenizer
        n = request.n
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        echoed, finished, offsets, out_tokens = set(), set(), {}, {}
        prompt_tokens, cached = {}, {}
        prompt_lps: dict[int, list] = {}
        try:
            async for i, out in merge_streams(streams):
                prompt_tokens[i] = len(out.prompt_token_ids)
                cached[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:   # the positions new since the last output
                    prompt_lps.setdefault(i, []).extend(out.prompt_logprobs)
                check_not_failed(out)
                for c in out.outputs:
                    idx = i * n + c.index
                    if idx in finished:
                        continue
                    if request.echo_only:
                        c = _echo_only(c)
                    text, ids, steps = c.text, list(c.token_ids), list(c.logprobs or [])
                    if request.echo and idx not in echoed:
                        pids, got = list(out.prompt_token_ids), prompt_lps.get(i, [])
                        # A long prompt's logprobs come one prefill chunk per step: echo it once
                        # they are all in (a token or a finish never waits).
                        if request.logprobs is not None and len(got) < len(pids) \
                                and not c.token_ids and c.finish_reason is None:
                            continue
                        echoed.add(idx)
                        text = (prompts[i].text or "") + text
                        ids = pids + ids
                        steps = (got + [None] * len(pids))[:len(pids)] + steps
                    out_tokens[idx] = out_tokens.get(idx, 0) + len(c.token_ids)
                    if not text and not c.token_ids and c.finish_reason is None:
                        continue
                    lp = None
                    if request.logprobs is not None:
                        lp = completion_logprobs(tok, ids, steps, offsets.get(idx, 0))
                    offsets[idx] = offsets.get(idx, 0) + len(text)
                    if c.finish_reason is not None:
                        finished.add(idx)
                    chunk = {"id": rid, "object": "text_completion", "created": created,
                             "model": model,
                             "choices": [{"index": idx, "text": text, "logprobs": lp,
                                          "finish_reason": c.finish_reason,
                                          "stop_reason": c.stop_reason}]}
                    if continuous:
                        chunk["usage"] = usage(sum(prompt_tokens.values()),
                                               sum(out_tokens.values()))
                    yield sse(chunk)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": model, "choices": [],
                           "usage": usage(sum(prompt_tokens.values()), sum(out_tokens.values()),
                                          sum(cached.values()))})
        except (EngineDeadError, OpenAIError) as e:
            err = e if isinstance(e, OpenAIError) else OpenAIError(503, str(e))
            yield sse(err.to_dict())
        finally:
            if usage_out is not None:
                usage_out.update(usage(sum(prompt_tokens.values()), sum(out_tokens.values())))
        yield SSE_DONE


def _echo_only(c: CompletionOutput) -> CompletionOutput:
    """A choice of an `echo` + `max_tokens: 0` request: the generated token left out."""
    done = c.finish_reason is not None
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None
                               else None, cumulative_logprob=None,
                               finish_reason="length" if done else None, stop_reason=None)
