"""`LLM`: the offline API (scripts, notebooks), shaped like vLLM's.

    llm = LLM()                                   # the embedded default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterable, Sequence

import jinja2

from jaxserve import config
from jaxserve.config import EngineArgs
from jaxserve.core.request import InvalidRequestError
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.logger import configure_default_logging
from jaxserve.lora.request import LoRARequest
from jaxserve.outputs import EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput
from jaxserve.pooling_params import PoolingParams
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Loads a model once and runs batches of prompts through the continuous-batching engine.

    Keyword arguments are `EngineArgs` fields (vLLM's names): dtype, max_model_len,
    kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization,
    kv_cache_memory_bytes, enable_prefix_caching, attention_backend, seed, ...
    `warmup=False` compiles each step shape on first use instead of at start-up.
    `warmup="background"` builds the decode and 16-token programs, the rest on a background
    thread while it serves (what `jaxserve serve` does; see `LLMEngine`).
    Use as a context manager, or call `shutdown()`, to free the KV pool at once.
    The step programs it compiles are kept in the engine's own program cache
    (`program_cache_dir`, default $JAXSERVE_PROGRAM_CACHE or ~/.cache/jaxserve/programs; ""
    turns it off), keyed by
    everything that changes them, so a second `LLM()` of the same model and flags loads them
    instead of compiling; jax.config is left as the program set it.
    `compilation_cache_dir="~/.cache/jaxserve/xla"` also turns on JAX's persistent compilation
    cache (as `jaxserve serve` does by default): that is jax's process-wide setting, every jitted
    function of the program lands there.
    """

    def __init__(self, model: str | None = None, *, warmup: bool | str = True, **kwargs):
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        kwargs.setdefault("program_cache_dir",       # a warm second start
                          os.environ.get("JAXSERVE_PROGRAM_CACHE", config.DEFAULT_PROGRAM_CACHE_DIR))
        self.engine_args = EngineArgs(model=model, **kwargs)
        configure_default_logging()
        self.llm_engine = LLMEngine(self.engine_args, warmup=warmup)
        self._counter = itertools.count()

    # -- vLLM's accessors ---------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate`/`chat` use when given no SamplingParams: the model's generation
        config (`generation_config`, `override_generation_config`) over vLLM's defaults."""
        return SamplingParams.from_optional(**self.llm_engine.default_sampling_params)

    @property
    def model_config(self):
        return self.llm_engine.model_config

    def __repr__(self) -> str:
        e = self.llm_engine
        if e is None or e.runner is None:
            return "LLM(shut down)"
        cfg = e.model_config
        return (f"LLM(model={e.model_name!r}, architecture={cfg.architecture}, "
                f"layers={cfg.num_layers}, dtype={e.runner.cache.dtype}, "
                f"max_model_len={e.max_model_len}, kv_blocks={e.cache_config.num_blocks}x"
                f"{e.cache_config.block_size}, prefix_caching={e.cache_config.enable_prefix_caching})")

    # -- generation ---------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a str, a {"prompt_token_ids": [...]} dict, or a list of those.
        `lora_request`: one adapter for every prompt, or one per prompt (None: the base model);
        needs `LLM(enable_lora=True)`. Returns one RequestOutput per prompt, in input order."""
        if self.llm_engine.runner is None:
            raise RuntimeError("this LLM has been shut down (shutdown() freed its model and KV "
                               "cache); create a new LLM to generate again")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif not isinstance(prompts, Iterable):
            raise TypeError("prompts must be a str, a {'prompt_token_ids': [...]} dict or a list of "
                            f"those, got {type(prompts).__name__}")
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must have one entry per prompt")
        loras = _per_prompt_loras(lora_request, len(prompts))
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                prompt = self._checked_prompt(prompt, sp)
                self.llm_engine.add_request(rid, prompt, sp,
                                            priority=0 if priority is None else priority[i],
                                            lora_request=loras[i])
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)   # leave the engine clean for the next call
            self.llm_engine.step()
            raise
        return self._run(ids, use_tqdm)

    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """A pooling model's (runner "pooling") pooled vector per prompt: a str, a
        {"prompt_token_ids": [...]} dict, a list of token ids, or a list of those. Returns one
        PoolingRequestOutput per prompt (`.outputs.data`, numpy float32), in input order."""
        if self.llm_engine.runner is None:
            raise RuntimeError("this LLM has been shut down; create a new LLM to encode again")
        if getattr(self.llm_engine, "pooling", None) is None:
            raise ValueError("LLM.embed / LLM.encode need a pooling model: create the LLM with "
                             "runner='pooling' (this one generates text)")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [(pooling_params or PoolingParams(task=pooling_task))] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError("The lengths of prompts and pooling_params must be the same.")
        ids = []
        try:
            for prompt, pp in zip(prompts, params):
                if truncate_prompt_tokens is not None:
                    pp = dataclasses.replace(pp, truncate_prompt_tokens=truncate_prompt_tokens)
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, pp)
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)
            self.llm_engine.step()
            raise
        outs = self._run(ids, use_tqdm)
        failed = next((o for o in outs if o.outputs is None), None)
        if failed is not None:
            raise RuntimeError(f"request {failed.request_id} ended with {failed.finish_reason!r} "
                               f"(its step failed: {self.llm_engine.last_step_error!r})")
        return outs

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`.outputs.embedding`, a list of floats), vLLM's
        `LLM.embed`: the model's pooling (LAST for Qwen3-Embedding, or --pooler-config), then
        `dimensions` and L2 normalization as `pooling_params` say (normalized by default)."""
        outs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                           use_tqdm=use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations.
        `tools` (OpenAI function definitions) go to the chat template, as do assistant
        messages with `tool_calls` and `role: "tool"` results; the outputs are text (parse
        calls with a tool parser, as `jaxserve serve --tool-call-parser` does)."""
        tok = self.get_tokenizer()
        prompts = []
        for where, conv in _conversations(messages):
            try:
                ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                              tokenize=True, chat_template=chat_template,
                                              tools=tools,
                                              continue_final_message=continue_final_message,
                                              **(chat_template_kwargs or {}))
            except (jinja2.TemplateError, TypeError, KeyError) as e:   # the template's own words
                raise ValueError(f"could not apply the chat template to {where}: "
                                 f"{type(e).__name__}: {e}") from None
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _checked_prompt(self, prompt, sp: SamplingParams) -> dict:
        """The prompt tokenized and checked, with max_tokens: prompt + max_tokens must fit in
        max_model_len (the server's 400, as a ValueError; max_tokens=None fills the context)."""
        engine = self.llm_engine
        text, token_ids = engine.tokenize_prompt(prompt)
        engine.validate_prompt(token_ids)
        n, limit = len(token_ids), engine.max_model_len
        if sp.max_tokens is not None and n + sp.max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens (max_model_len). However, "
                f"you requested {n + sp.max_tokens} tokens ({n} in the prompt, {sp.max_tokens} in "
                "max_tokens). Lower max_tokens, or pass max_tokens=None to generate up to "
                "max_model_len.", "max_tokens")
        return {"prompt": text, "prompt_token_ids": token_ids}

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        # As vLLM: a dict is refused rather than guessed at (SamplingParams validates fields).
        if isinstance(sampling_params, (dict, str)) or not isinstance(sampling_params, Iterable):
            raise TypeError("sampling_params must be a SamplingParams or a list of them (one per "
                            f"prompt), got {type(sampling_params).__name__}"
                            + (": use SamplingParams(**params)" if isinstance(sampling_params, dict)
                               else ""))
        sampling_params = list(sampling_params)
        bad = next((i for i, sp in enumerate(sampling_params) if not isinstance(sp, SamplingParams)),
                   None)
        if bad is not None:
            raise TypeError(f"sampling_params[{bad}] must be a SamplingParams, got "
                            f"{type(sampling_params[bad]).__name__}")
        if len(sampling_params) != n:
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        return sampling_params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = _Progress(len(ids), engine) if use_tqdm else None
        try:
            while len(done) < len(ids) and engine.has_unfinished_requests():
                finished = [out for out in engine.step() if out.finished]
                done.update((out.request_id, out) for out in finished)
                if bar is not None:
                    bar.step(len(finished))
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    # -- lifetime -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Free the KV pool and weights now (a notebook can re-run its cell without leaking)."""
        if self.llm_engine is not None:
            self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


class _Progress:
    """The tqdm bar of `generate`: prompts done, with vLLM's postfix "est. speed input: X
    toks/s, output: Y toks/s" refreshed as the engine works (prompt tokens count once their
    prefill is done, output tokens as sampled), not only when a request finishes."""

    REFRESH_S = 0.5

    def __init__(self, total: int, engine: LLMEngine):
        from tqdm.auto import tqdm
        self.engine = engine
        self.tokens0 = (engine.prompt_tokens_total, engine.generation_tokens_total)
        self.start = self.shown = time.perf_counter()
        self.bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                        postfix=self._speed(self.start))

    def _speed(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        prompt = self.engine.prompt_tokens_total - self.tokens0[0]
        output = self.engine.generation_tokens_total - self.tokens0[1]
        return (f"est. speed input: {prompt / elapsed:.2f} toks/s, "
                f"output: {output / elapsed:.2f} toks/s")

    def step(self, finished: int) -> None:
        now = time.perf_counter()
        if not finished and now - self.shown < self.REFRESH_S:
            return
        self.shown = now
        self.bar.set_postfix_str(self._speed(now), refresh=not finished)
        if finished:
            self.bar.update(finished)

    def close(self) -> None:
        self.bar.close()


def _per_prompt_loras(lora_request, n: int) -> list:
    """One LoRARequest (or None) per prompt from generate's `lora_request` argument."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if isinstance(lora_request, (str, dict)) or not isinstance(lora_request, Iterable):
        raise TypeError("lora_request must be a LoRARequest or a list of them (None for the base "
                        f"model), got {type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != n:
        raise ValueError(f"lora_request: {len(loras)} entries for {n} prompts")
    bad = next((i for i, r in enumerate(loras) if r is not None and not isinstance(r, LoRARequest)), None)
    if bad is not None:
        raise TypeError(f"lora_request[{bad}] must be a LoRARequest or None, got {type(loras[bad]).__name__}")
    return loras


def _conversations(messages) -> list[tuple[str, list[dict]]]:
    """`chat`'s messages, one conversation or a list of them, as (name for errors, conversation)
    pairs; a TypeError / ValueError naming the argument when the shape is wrong."""
    expected = ("a conversation (a list of {'role': ..., 'content': ...} dicts) or a list of "
                "conversations")
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be {expected}, got {type(messages).__name__}")
    if messages and isinstance(messages[0], dict):
        named = [("messages", messages)]
    else:
        named = [(f"messages[{i}]", conv) for i, conv in enumerate(messages)]
    for where, conv in named:
        if isinstance(conv, (str, bytes, dict)) or not isinstance(conv, Sequence):
            raise TypeError(f"{where} must be a list of {{'role': ..., 'content': ...}} dicts "
                            f"(messages must be {expected}), got {type(conv).__name__}")
        for j, message in enumerate(conv):
            if not isinstance(message, dict):
                raise TypeError(f"{where}[{j}] must be a dict with 'role' and 'content', got "
                                f"{type(message).__name__}")
            if not isinstance(message.get("role"), str):
                raise ValueError(f"{where}[{j}] needs a 'role' (a string: 'system', 'user', "
                                 f"'assistant' or 'tool'), got {message.get('role')!r}")
    return named
