"""Endpoint logic of the OpenAI-compatible API, independent of HTTP.

`OpenAIServing(engine: AsyncLLM, served_model_names)` has one coroutine per endpoint taking a
validated request model. Non-streaming calls return the JSON body as a dict; streaming calls
return an async iterator of SSE strings (`"data: {...}\\n\\n"`, ending with `"data: [DONE]\\n\\n"`)
after the request has been accepted, so every validation failure is raised before the first
byte as an `OpenAIError` (400, 404, 503). The aiohttp routes (api_server.py) and the offline batch
runner both call these.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestStream
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.openai.chat_output import (
    ChatOutputParser,
    finish_reason_for,
    with_reasoning_content,
)
from jaxserve.server.openai.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_json
from jaxserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    OpenAIError,
    TokenizeRequest,
    model_card,
    usage,
)
from jaxserve.server.openai.reasoning import get_reasoning_parser
from jaxserve.server.openai.streams import check_not_failed, collect_all, merge_streams
from jaxserve.server.openai.tool_parsers import get_tool_parser

logger = logging.getLogger("jaxserve.server")

__all__ = ["OpenAIServing", "OpenAIError", "SSEStream", "sse", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"

# Inputs larger than this (characters of text, or token ids) are tokenized, templated and checked
# on a worker thread, so one huge prompt (seconds of tokenizing) does not stall every other
# request on the event loop; smaller ones stay inline, where a thread hop would cost more than the
# work and could queue them behind a huge one.
OFF_LOOP_MIN_SIZE = 16_384

# The template that renders `tools` for ChatML models such as the default one (hermes tool calls).
CHATML_TOOLS_TEMPLATE = os.path.join(os.path.dirname(__file__), "chat_templates",
                                     "tool_chat_template_chatml_hermes.jinja")


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class SSEStream:
    """A streamed response: its SSE lines (`async for`, `aclose()`) and `usage`, the token counts
    of what was generated, filled in when the stream ends or is closed (for the access log).
    `aclose()` also closes (aborts) `streams`: a generator closed before its first line skips
    its own `finally`."""

    def __init__(self, lines: AsyncIterator[str], usage_out: dict,
                 streams: list[RequestStream] = ()):
        self._lines = lines
        self.usage = usage_out
        self._streams = streams

    def __aiter__(self):
        return self._lines.__aiter__()

    async def aclose(self) -> None:
        try:
            await self._lines.aclose()
        finally:
            for s in self._streams:
                s.close()


class _Prompt:
    """One prompt after tokenization: its text (for echo) and token ids."""

    def __init__(self, text: str | None, token_ids: list[int]):
        self.text = text
        self.token_ids = token_ids


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str] | None = None,
                 response_role: str = "assistant", model_root: str | None = None, *,
                 enable_auto_tools: bool = False, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, chat_template: str | None = None, lora=None):
        """enable_auto_tools, tool_parser, reasoning_parser, chat_template: the server's
        --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser and --chat-template
        (the template text)."""
        self.engine = engine
        self.served_model_names = list(served_model_names or [])
        self.response_role = response_role
        self.model_root = model_root
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = get_tool_parser(tool_parser) if tool_parser else None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser \
            else None
        self.chat_template = chat_template
        # LoRA adapters served as models (server/openai/lora.py's LoraModels), or None
        self.lora = lora
        # tokenizers releases the GIL while it encodes, so these threads leave the loop free
        self._cpu = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxserve-tokenize",
                                       initializer=_lower_thread_priority)
        if enable_auto_tools:
            self._warn_if_template_ignores_tools()

    def _warn_if_template_ignores_tools(self) -> None:
        template = self.chat_template or self.engine.tokenizer.chat_template
        if template and not template_renders_tools(self.engine.tokenizer, template):
            logger.warning(
                "--enable-auto-tool-choice is set but the chat template ignores `tools` (it "
                "renders the same prompt with and without them): the model is never told which "
                "tools exist, so tool_choice \"auto\" answers in plain text. Give a template that "
                "renders tools with --chat-template, e.g. %s (ChatML models such as the default "
                "one, with --tool-call-parser hermes).", CHATML_TOOLS_TEMPLATE)

    async def _off_loop(self, size: int, fn, *args):
        """fn(*args) inline when the input is small (size <= OFF_LOOP_MIN_SIZE), else on the
        worker threads, so the event loop keeps answering other requests meanwhile."""
        if size <= OFF_LOOP_MIN_SIZE:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def close(self) -> None:
        self._cpu.shutdown(wait=False, cancel_futures=True)

    # -- shared checks ------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.served_model_names[0] if self.served_model_names else self.engine.model_name

    def check_model(self, name: str | None) -> str:
        names = self.served_model_names or [self.engine.model_name]
        if name is None or name in names:
            return name or names[0]
        if self.lora is not None and name in self.lora:     # an adapter's name
            return name
        raise OpenAIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")

    def _check_prompt(self, token_ids: list[int], max_tokens: int | None) -> int:
        """Validate one prompt; returns the default max_tokens (room left in the context)."""
        n, limit = len(token_ids), self.engine.max_model_len
        if n == 0:
            raise OpenAIError(400, "The decoder prompt cannot be empty", param="prompt")
        if max_tokens is None and n >= limit:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. "
                                   f"However, your request has {n} input tokens. Please reduce "
                                   "the length of the input messages.", param="messages")
        if max_tokens is not None and n + max_tokens > limit:
            raise OpenAIError(400, f"This model's maximum context length is {limit} tokens. "
                                   f"However, you requested {n + max_tokens} tokens ({n} in the "
                                   f"messages, {max_tokens} in the completion). Please reduce "
                                   "the length of the messages or completion.",
                              param="max_tokens")
        vocab = self.engine.vocab_size     # after the length: a refused huge prompt is not scanned
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"Token id {bad} is out of vocabulary (prompt_token_ids must "
                                   f"be in [0, {vocab}))", param="prompt")
        return limit - n

    def _check_logprobs(self, num: int | None, param: str) -> None:
        top = self.engine.max_logprobs
        if num is not None and not 0 <= num <= top:
            raise OpenAIError(400, f"`{param}` must be in [0, {top}], got {num} (the server's "
                                   f"--max-logprobs is {top})", param=param)

    def _params(self, build, default_max_tokens: int) -> SamplingParams:
        """Build a request's SamplingParams; also check what needs the server's limits."""
        try:
            params = build(default_max_tokens, self.engine.default_sampling_params)
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        most = self.engine.engine_args.max_num_seqs
        if params.n > most:   # n children are n requests; more than can run at once is refused
            raise OpenAIError(400, f"n must be at most {most} (the server's --max-num-seqs), "
                                   f"got {params.n}", param="n")
        vocab = self.engine.vocab_size
        bad = next((t for t in params.logit_bias or {} if t >= vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"logit_bias token id {bad} is out of vocabulary (token ids "
                                   f"must be in [0, {vocab}))", param="logit_bias")
        return params

    async def _add(self, request_id: str, prompt: _Prompt, params: SamplingParams,
                   priority: int, lora=None) -> RequestStream:
        try:
            return await self.engine.add_request(
                request_id, {"prompt_token_ids": prompt.token_ids, "prompt": prompt.text},
                params, priority, **({} if lora is None else {"lora_request": lora}))
        except ValueError as e:
            raise OpenAIError(400, str(e), param=getattr(e, "param", None)) from None
        except (EngineOverloadedError, EngineDeadError) as e:
            raise OpenAIError(503, str(e)) from None

    async def _add_all(self, base_id: str, prompts: list[_Prompt], params: list[SamplingParams],
                       priority: int, model: str | None = None) -> list[RequestStream]:
        """Queue the prompts; `model` (the checked name) runs them under its LoRA adapter."""
        lora = self.lora.get(model) if self.lora is not None else None
        streams: list[RequestStream] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self._add(rid, prompt, sp, priority, lora))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    # -- /v1/completions ----------------------------------------------------------------------
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

    def _truncation(self, k: int | None, max_tokens: int | None) -> int | None:
        """truncate_prompt_tokens: keep the last k prompt tokens; -1 (vLLM's meaning) keeps as
        many as fit in the context with max_tokens (at least one) after them."""
        if k != -1:
            return k
        return max(self.engine.max_model_len - max(max_tokens or 0, 1), 1)

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

    # -- /v1/chat/completions -----------------------------------------------------------------
    def _chat_prompt(self, request: ChatCompletionRequest) -> _Prompt:
        messages = [_flatten_content(m, i) for i, m in enumerate(request.messages)]
        tok = self.engine.tokenizer
        try:
            text = tok.apply_chat_template(
                messages, add_generation_prompt=request.add_generation_prompt, tokenize=False,
                tools=request.tools, chat_template=request.chat_template or self.chat_template,
                continue_final_message=request.continue_final_message,
                **request.template_kwargs())
            # vLLM's default for chat: the template writes BOS, the tokenizer adds nothing
            ids = tok.encode(text, add_special_tokens=bool(request.add_special_tokens))
        except (ValueError, TypeError, KeyError) as e:
            raise OpenAIError(400, f"could not apply the chat template: {e}",
                              param="messages") from None
        except Exception as e:      # jinja2 errors (raise_exception in templates)
            raise OpenAIError(400, f"could not apply the chat template: {e}",
                              param="messages") from None
        k = self._truncation(request.truncate_prompt_tokens, request.requested_max_tokens())
        if k is not None and len(ids) > k:
            ids = ids[-k:]        # keep the last k tokens, as for completions
        return _Prompt(None, ids)

    def _prepare_chat(self, request: ChatCompletionRequest) -> tuple[_Prompt, int]:
        prompt = self._chat_prompt(request)
        return prompt, self._check_prompt(prompt.token_ids, request.requested_max_tokens())

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     request_id: str | None = None) -> dict | SSEStream:
        model = self.check_model(request.model)
        if request.logprobs:
            self._check_logprobs(request.top_logprobs, "top_logprobs")
        self._check_logprobs(request.prompt_logprobs, "prompt_logprobs")
        if not request.messages:
            raise OpenAIError(400, "messages must contain at least one message",
                              param="messages")
        if request.uses_tools and request.tool_choice == "auto" and \
                not (self.enable_auto_tools and self.tool_parser is not None):
            raise OpenAIError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                                   "--tool-call-parser to be set", param="tool_choice")
        prompt, room = await self._off_loop(_input_size(request.messages), self._prepare_chat,
                                            request)
        params = self._params(request.to_sampling_params, room)
        parser = self._output_parser(request)
        if parser is not None and parser.tools is not None and parser.tools.keeps_special_tokens:
            params.skip_special_tokens = False    # the call markers may be special tokens
        base_id = request_id or request.request_id or random_id("chatcmpl")
        streams = await self._add_all(base_id, [prompt], [params], request.priority, model)
        created = int(time.time())
        if request.stream:
            usage_out: dict = {}
            return SSEStream(self._chat_stream(request, model, base_id, created, streams,
                                               usage_out), usage_out, streams)
        (out,) = await collect_all(streams)
        return self._chat_response(request, model, base_id, created, out)

    def _output_parser(self, request: ChatCompletionRequest) -> ChatOutputParser | None:
        return ChatOutputParser.for_request(request, self.tool_parser, self.reasoning_parser)

    def _echo_prefix(self, request: ChatCompletionRequest) -> str:
        if request.echo and request.messages and \
                request.messages[-1].get("role") == self.response_role:
            return _flatten_content(request.messages[-1], len(request.messages) - 1).get("content") or ""
        return ""

    def _chat_response(self, request, model, rid, created, out: RequestOutput) -> dict:
        tok = self.engine.tokenizer
        prefix = self._echo_prefix(request)
        choices, completion_tokens = [], 0
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            lp = chat_logprobs(tok, c.token_ids, c.logprobs or [], request.top_logprobs or 0) \
                if request.logprobs else None
            message = {"role": self.response_role, "content": prefix + c.text, "tool_calls": []}
            finish_reason = c.finish_reason
            parser = self._output_parser(request)
            if parser is not None:
                parsed = parser.message(c.text, cut=finish_reason == "length")
                message["content"] = prefix + (parsed["content"] or "") if prefix \
                    else parsed["content"]
                message["tool_calls"] = parsed["tool_calls"]
                if parser.reasoning is not None:
                    message["reasoning"] = message["reasoning_content"] = parsed["reasoning"]
                finish_reason = finish_reason_for(request, finish_reason,
                                                  bool(parsed["tool_calls"]))
            choices.append({"index": c.index, "message": message, "logprobs": lp,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "usage": usage(len(out.prompt_token_ids), completion_tokens,
                               out.num_cached_tokens)}
        if request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return body

    async def _chat_stream(self, request, model, rid, created, streams,
                           usage_out: dict | None = None) -> AsyncIterator[str]:
        tok = self.engine.tokenizer
        n = request.n or 1
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        prefix = self._echo_prefix(request)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        finished, out_tokens = set(), {}
        prompt_tokens, cached = 0, 0
        parsers = {i: self._output_parser(request) for i in range(n)}
        try:
            for i in range(n):
                first = {**base, "choices": [{"index": i,
                                              "delta": {"role": self.response_role,
                                                        "content": prefix},
                                              "logprobs": None, "finish_reason": None}]}
                if continuous:
                    first["usage"] = usage(0, 0)
                yield sse(first)
            async for _, out in merge_streams(streams):
                check_not_failed(out)
                prompt_tokens, cached = len(out.prompt_token_ids), out.num_cached_tokens
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    out_tokens[c.index] = out_tokens.get(c.index, 0) + len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    lp = chat_logprobs(tok, c.token_ids, c.logprobs or [],
                                       request.top_logprobs or 0) if request.logprobs else None
                    if c.finish_reason is not None:
                        finished.add(c.index)
                    parser = parsers.get(c.index)
                    finish_reason = c.finish_reason
                    if parser is None:
                        deltas = [{"content": c.text} if (c.text or c.finish_reason is None)
                                  else {}]
                    else:
                        deltas = [with_reasoning_content(d) for d in parser.feed(
                            c.text, c.finish_reason is not None, c.finish_reason == "length")]
                        finish_reason = finish_reason_for(request, finish_reason,
                                                          parser.tools_called)
                        if not deltas and (finish_reason is not None or lp is not None):
                            deltas = [{}]
                    for k, delta in enumerate(deltas):
                        last = k == len(deltas) - 1
                        chunk = {**base, "choices": [{
                            "index": c.index, "delta": delta, "logprobs": lp if k == 0 else None,
                            "finish_reason": finish_reason if last else None,
                            "stop_reason": c.stop_reason if last else None}]}
                        if continuous:
                            chunk["usage"] = usage(prompt_tokens, sum(out_tokens.values()))
                        yield sse(chunk)
            if include_usage:
                yield sse({**base, "choices": [],
                           "usage": usage(prompt_tokens, sum(out_tokens.values()), cached)})
        except (EngineDeadError, OpenAIError) as e:
            err = e if isinstance(e, OpenAIError) else OpenAIError(503, str(e))
            yield sse(err.to_dict())
        finally:
            if usage_out is not None:
                usage_out.update(usage(prompt_tokens, sum(out_tokens.values())))
        yield SSE_DONE

    # -- models, tokenize ---------------------------------------------------------------------
    def show_models(self) -> dict:
        names = self.served_model_names or [self.engine.model_name]
        root = self.model_root or names[0]
        cards = [model_card(name, root, self.engine.max_model_len) for name in names]
        if self.lora is not None:
            cards += self.lora.cards(root, self.engine.max_model_len)
        return {"object": "list", "data": cards}

    async def tokenize(self, request: TokenizeRequest) -> dict:
        self.check_model(request.model)
        size = _input_size(request.messages if request.prompt is None else request.prompt)
        return await self._off_loop(size, self._tokenize, request)

    def _tokenize(self, request: TokenizeRequest) -> dict:
        tok = self.engine.tokenizer
        if request.messages is not None:
            messages = [_flatten_content(m, i) for i, m in enumerate(request.messages)]
            try:
                ids = tok.apply_chat_template(messages,
                                              add_generation_prompt=request.add_generation_prompt,
                                              tokenize=True, chat_template=self.chat_template)
            except Exception as e:
                raise OpenAIError(400, f"could not apply the chat template: {e}",
                                  param="messages") from None
        else:
            ids = tok.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if request.return_token_strs
                else None}

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        return await self._off_loop(len(request.tokens), self._detokenize, request)

    def _detokenize(self, request: DetokenizeRequest) -> dict:
        vocab = self.engine.vocab_size
        bad = next((t for t in request.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"Token id {bad} is out of vocabulary", param="tokens")
        return {"prompt": self.engine.tokenizer.decode(request.tokens)}

    def tokenizer_info(self) -> dict:
        """GET /tokenizer_info (vLLM's): the tokenizer's configuration as tokenizer_config.json
        writes it (file paths left out, special tokens as their text) with `tokenizer_class`
        and the chat template this server renders; lm-evaluation-harness's remote tokenizer
        reads the special tokens and the template from it."""
        tok = self.engine.tokenizer
        info = {k: _plain(v) for k, v in (tok.config or {}).items()
                if k not in ("vocab_file", "merges_file")}
        info["added_tokens_decoder"] = {str(i): t.content for i, t in
                                        sorted(tok.backend.get_added_tokens_decoder().items())}
        info.update(bos_token=tok.bos_token, eos_token=tok.eos_token, unk_token=tok.unk_token,
                    pad_token=tok.pad_token, add_bos_token=tok.add_bos_token,
                    name_or_path=self.model_root or self.model_name)
        info.setdefault("model_max_length", self.engine.max_model_len)
        cls = info.get("tokenizer_class") or "PreTrainedTokenizer"
        info["tokenizer_class"] = cls if cls.endswith("Fast") else cls + "Fast"  # as loaded
        template = self.chat_template or tok.chat_template
        if template:
            info["chat_template"] = template
        return info


# -- helpers ----------------------------------------------------------------------------------
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


def _lower_thread_priority() -> None:
    """Tokenizing a huge prompt is bulk work: on Linux (where a nice value is per thread) the
    worker thread yields the CPU to the engine step and the event loop, so short requests keep
    their latency while it runs. Elsewhere setpriority would renice the whole process: skipped."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass


def _input_size(value) -> int:
    """How big a prompt or message list is: characters of text plus token ids (for the
    off-the-loop decision; no validation)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_input_size(v) for v in value.values())
    if isinstance(value, list):
        return sum(_input_size(v) if isinstance(v, (str, list, dict)) else 1 for v in value)
    return 0


def _plain(value):
    """tokenizer_config.json values as JSON: an AddedToken dict becomes its text."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and "lstrip" in value:
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _echo_only(c: CompletionOutput) -> CompletionOutput:
    """A choice of an `echo` + `max_tokens: 0` request: the generated token left out."""
    done = c.finish_reason is not None
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None
                               else None, cumulative_logprob=None,
                               finish_reason="length" if done else None, stop_reason=None)


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
