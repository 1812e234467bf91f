"""What every endpoint of `OpenAIServing` shares: the served model names, the request checks that
need the server's limits (context length, vocabulary, logprobs, n), queueing prompts on the engine
(and under a LoRA adapter), and tokenizing large inputs off the event loop on a small thread pool.
`OpenAIServingBase` holds them; the endpoint classes (serving_completions.py, serving_chat.py)
build on it and serving.py joins them into `OpenAIServing`."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

from jaxserve.engine.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError, RequestStream
from jaxserve.sampling_params import SamplingParams
from jaxserve.server.openai.protocol import OpenAIError
from jaxserve.server.openai.reasoning import get_reasoning_parser
from jaxserve.server.openai.templates import CHATML_TOOLS_TEMPLATE, template_renders_tools
from jaxserve.server.openai.tool_parsers import get_tool_parser

logger = logging.getLogger("jaxserve.server")

# Inputs larger than this (characters of text, or token ids) are tokenized, templated and checked
# on a worker thread, so one huge prompt (seconds of tokenizing) does not stall every other
# request on the event loop; smaller ones stay inline, where a thread hop would cost more than the
# work and could queue them behind a huge one.
OFF_LOOP_MIN_SIZE = 16_384


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Prompt:
    """One prompt after tokenization: its text (for echo) and token ids."""

    def __init__(self, text: str | None, token_ids: list[int]):
        self.text = text
        self.token_ids = token_ids


class OpenAIServingBase:
    """The state and checks every endpoint uses (see the module docstring)."""

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

    def _truncation(self, k: int | None, max_tokens: int | None) -> int | None:
        """truncate_prompt_tokens: keep the last k prompt tokens; -1 (vLLM's meaning) keeps as
        many as fit in the context with max_tokens (at least one) after them."""
        if k != -1:
            return k
        return max(self.engine.max_model_len - max(max_tokens or 0, 1), 1)

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
