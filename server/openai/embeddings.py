"""`POST /v1/embeddings` (OpenAI's request and response shapes, vLLM's extra fields) for a
pooling model (`--runner pooling`).

`input` is a string, a list of strings, a list of token ids or a list of token id lists; each
item is one prompt, embedded by the engine's pooling runner in one batch. `encoding_format`
"float" gives lists of floats, "base64" the little-endian float32 bytes base64-encoded (what the
official `openai` client asks for by default). `dimensions` truncates a Matryoshka model's
embeddings (a 400 for other models).
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from jaxserve.engine.async_llm import EngineDeadError
from jaxserve.pooling_params import PoolingParams
from jaxserve.server.openai.protocol import OpenAIBaseModel, OpenAIError
from jaxserve.server.openai.serving_base import _Prompt


class EmbeddingRequest(OpenAIBaseModel):
    # OpenAI fields, in the order of https://platform.openai.com/docs/api-reference/embeddings
    input: list[int] | list[list[int]] | str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool = True
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncation(cls, k):
        if k == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or a positive integer")
        return k

    def to_pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             dimensions=self.dimensions, normalize=self.normalize, task="embed")


def _items(value) -> list:
    """`input` as a list of prompts (each a str or a list of token ids)."""
    if isinstance(value, str):
        return [value]
    if value and isinstance(value[0], int):
        return [list(value)]
    return list(value)


def embedding_prompts(request: EmbeddingRequest, tokenizer, max_model_len: int,
                      vocab_size: int) -> list[tuple[str | None, list[int]]]:
    """Tokenize and check each input: (text, token ids). 400s name `input` (and the item)."""
    items = _items(request.input)
    if not items:
        raise OpenAIError(400, "input must not be empty", param="input")
    k = request.truncate_prompt_tokens
    k = max_model_len if k == -1 else k
    prompts = []
    for i, item in enumerate(items):
        where = "input" if len(items) == 1 else f"input[{i}]"
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=request.add_special_tokens) if item else []
            text = item
        else:
            ids, text = list(item), None
        if not ids:
            raise OpenAIError(400, f"{where} must not be empty (an embedding needs at least one "
                                   "token)", param="input")
        if k is not None and len(ids) > k:
            ids, text = ids[-k:], None
        if len(ids) > max_model_len:
            raise OpenAIError(400, f"This model's maximum context length is {max_model_len} "
                                   f"tokens. However, you requested {len(ids)} tokens in the "
                                   f"input for embedding generation ({where}). Please reduce the "
                                   "length of the input, or set truncate_prompt_tokens.",
                              param="input")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise OpenAIError(400, f"{where}: token id {bad} is out of vocabulary (token ids must "
                                   f"be in [0, {vocab_size}))", param="input")
        prompts.append((text, ids))
    return prompts


def encode_embedding(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


async def create_embedding(serving, request: EmbeddingRequest, request_id: str | None) -> dict:
    """The /v1/embeddings answer; `serving` is the server's OpenAIServing (its engine, model
    names, admission helper and tokenizer threads)."""
    engine = serving.engine
    if engine.pooler is None:
        raise OpenAIError(400, "The model does not support Embeddings API: it runs as a "
                               "generative model (start it with --runner pooling)", param="model")
    model = serving.check_model(request.model)
    params = request.to_pooling_params()
    try:
        engine.engine.pooling.check_params(params)      # what the model can return
    except ValueError as e:
        raise OpenAIError(400, str(e), param="dimensions") from None
    size = len(request.input) if isinstance(request.input, str) else sum(
        len(x) if isinstance(x, (str, list)) else 1 for x in request.input)
    prompts = await serving._off_loop(size, embedding_prompts, request, engine.tokenizer,
                                      engine.max_model_len, engine.vocab_size)
    base_id = request_id or request.request_id or f"embd-{time.time_ns():x}"
    streams = []
    try:
        for i, (text, ids) in enumerate(prompts):
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            streams.append(await serving._add(rid, _Prompt(text, ids), params, request.priority))
        finals = await _finals(streams)
    finally:
        for s in streams:
            s.close()
    data = [{"object": "embedding", "index": i,
             "embedding": encode_embedding(out.outputs.data, request.encoding_format)}
            for i, out in enumerate(finals)]
    tokens = sum(len(out.prompt_token_ids) for out in finals)
    return {"id": base_id, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def _finals(streams) -> list:
    async def last(stream):
        final = None
        async for out in stream:
            final = out
        return final

    try:
        finals = await asyncio.gather(*(last(s) for s in streams))
    except EngineDeadError as e:
        raise OpenAIError(503, str(e)) from None
    for out in finals:
        if out is None or out.outputs is None:
            raise OpenAIError(500, "Internal server error: the engine step that computed this "
                                   "embedding failed (the server keeps serving; retry the "
                                   "request)", "InternalServerError")
    return list(finals)
