"""`/v1/chat/completions`: rendering a chat request's messages through the chat template, queueing
the prompt, and its answer as one JSON body or as SSE chunks, with tool calls and reasoning read
out of the text by the request's output parser (chat_output.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from jaxserve.engine.async_llm import EngineDeadError
from jaxserve.outputs import RequestOutput
from jaxserve.server.openai.chat_output import (
    ChatOutputParser,
    finish_reason_for,
    with_reasoning_content,
)
from jaxserve.server.openai.logprobs import chat_logprobs, prompt_logprobs_json
from jaxserve.server.openai.protocol import ChatCompletionRequest, OpenAIError, usage
from jaxserve.server.openai.serving_base import OpenAIServingBase, _input_size, _Prompt, random_id
from jaxserve.server.openai.sse import SSE_DONE, SSEStream, sse
from jaxserve.server.openai.streams import check_not_failed, collect_all, merge_streams
from jaxserve.server.openai.templates import _flatten_content


class ChatServing(OpenAIServingBase):
    """The /v1/chat/completions endpoint (`create_chat_completion`)."""

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
