"""`LLM`: the offline API (scripts, notebooks), shaped like vLLM's.

    llm = LLM()                                   # the embedded default model
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs = llm.chat([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from jaxserve.config import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
from jaxserve.logger import configure_default_logging
from jaxserve.outputs import RequestOutput
from jaxserve.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Loads a model once and runs batches of prompts through the continuous-batching engine.

    Keyword arguments are `EngineArgs` fields (vLLM's names): dtype, max_model_len,
    kv_cache_dtype, block_size, max_num_seqs, max_num_batched_tokens, gpu_memory_utilization,
    kv_cache_memory_bytes, enable_prefix_caching, attention_backend, seed, ...
    `warmup=False` compiles each step shape on first use instead of at start-up.
    Use as a context manager, or call `shutdown()`, to free the KV pool at once.
    `compilation_cache_dir="~/.cache/jaxserve/xla"` keeps compiled programs in JAX's persistent
    compilation cache so a second start is fast (as `jaxserve serve` does by default). That is
    jax's process-wide setting (every jitted function of the program lands there), so without
    the argument `LLM` leaves `jax.config` as the program set it.
    """

    def __init__(self, model: str | None = None, *, warmup: bool = True, **kwargs):
        unknown = set(kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        self.engine_args = EngineArgs(model=model, **kwargs)
        configure_default_logging()
        self.llm_engine = LLMEngine(self.engine_args, warmup=warmup)
        self._counter = itertools.count()

    # -- vLLM's accessors ---------------------------------------------------------------------
    def get_tokenizer(self):
        return self.llm_engine.tokenizer

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
                 = None, use_tqdm: bool = True, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a str, a {"prompt_token_ids": [...]} dict, or a list of those.
        Returns one RequestOutput per prompt, in input order."""
        if self.llm_engine.runner is None:
            raise RuntimeError("this LLM has been shut down (shutdown() freed its model and KV "
                               "cache); create a new LLM to generate again")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must have one entry per prompt")
        ids = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                sp = sp.clone()
                sp.output_kind = RequestOutputKind.FINAL_ONLY
                self.llm_engine.add_request(rid, prompt, sp,
                                            priority=0 if priority is None else priority[i])
                ids.append(rid)
        except Exception:
            self.llm_engine.abort_request(ids)   # leave the engine clean for the next call
            self.llm_engine.step()
            raise
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations.
        `tools` (OpenAI function definitions) go to the chat template, as do assistant
        messages with `tool_calls` and `role: "tool"` results; the outputs are text (parse
        calls with a tool parser, as `jaxserve serve --tool-call-parser` does)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                          tokenize=True, chat_template=chat_template,
                                          tools=tools,
                                          continue_final_message=continue_final_message,
                                          **(chat_template_kwargs or {}))
            prompts.append({"prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        return sampling_params

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        start, in_toks, out_toks = time.perf_counter(), 0, 0
        while len(done) < len(ids) and engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                done[out.request_id] = out
                in_toks += len(out.prompt_token_ids)
                out_toks += sum(len(c.token_ids) for c in out.outputs)
                if bar is not None:
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"est. speed input: {in_toks / elapsed:.1f} toks/s, "
                                        f"output: {out_toks / elapsed:.1f} toks/s")
                    bar.update(1)
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
