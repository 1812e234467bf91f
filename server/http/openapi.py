"""The OpenAPI 3.1 document served at `/openapi.json`, built from the same pydantic models that
validate the requests, so the description cannot drift from what the server accepts. Clients and
fuzzers (the test suite runs schemathesis against it) read it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from jaxserve.server.openai.embeddings import EmbeddingRequest
from jaxserve.server.openai.lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from jaxserve.server.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from jaxserve.server.openai.responses_protocol import ResponsesRequest

_REF = "#/components/schemas/{model}"
_ERRORS = {"400": "invalid request", "401": "missing or wrong API key",
           "404": "unknown model or route", "413": "request body too large",
           "503": "engine not ready, overloaded or dead"}


def _schema(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    """Register `model` (and the models it nests) as components; returns a $ref to it."""
    schema = model.model_json_schema(ref_template=_REF)
    components.update(schema.pop("$defs", {}))
    components[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def _json(schema: dict) -> dict:
    return {"content": {"application/json": {"schema": schema}}}


def openapi_document(version: str) -> dict[str, Any]:
    components: dict[str, Any] = {}
    error = _schema(ErrorResponse, components)
    errors = {code: {"description": text, **_json(error)} for code, text in _ERRORS.items()}
    obj = {"type": "object"}

    def post(model: type[BaseModel], summary: str, streams: bool, ok: dict | None = None) -> dict:
        ok = ok or {"description": "the result" + (" (text/event-stream when stream is true)"
                                                   if streams else ""), **_json(obj)}
        return {"post": {"summary": summary, "requestBody": {"required": True,
                                                             **_json(_schema(model, components))},
                         "responses": {"200": ok, **errors}}}

    def get(summary: str, content: str | None = "application/json") -> dict:
        ok = {"description": summary}
        if content == "application/json":
            ok.update(_json(obj))
        return {"get": {"summary": summary, "responses": {"200": ok, **errors}}}

    response_id = {"parameters": [{"name": "response_id", "in": "path", "required": True,
                                   "schema": {"type": "string"}}]}
    lora_ok = {"description": "a success sentence naming the adapter",
               "content": {"text/plain": {"schema": {"type": "string"}}}}
    paths = {
        "/v1/completions": post(CompletionRequest, "Create a completion", True),
        "/v1/chat/completions": post(ChatCompletionRequest, "Create a chat completion", True),
        "/v1/responses": post(ResponsesRequest, "Create a response (OpenAI's Responses API)", True),
        "/v1/responses/{response_id}": {
            **response_id, "get": get("A stored response")["get"],
            "delete": get("Delete a stored response")["get"]},
        "/v1/embeddings": post(EmbeddingRequest, "Create embeddings (pooling models: "
                               "--runner pooling)", False),
        # 400 also when the server runs without --enable-lora; 404 without
        # --allow-runtime-lora-updating, or (unload) for an adapter not loaded
        "/v1/load_lora_adapter": post(LoadLoRAAdapterRequest, "Load a LoRA adapter, served as the model "
                                      "`lora_name` (--allow-runtime-lora-updating)", False, lora_ok),
        "/v1/unload_lora_adapter": post(UnloadLoRAAdapterRequest, "Unload a LoRA adapter "
                                        "(--allow-runtime-lora-updating)", False, lora_ok),
        "/tokenize": post(TokenizeRequest, "Tokenize a prompt or chat messages", False),
        "/detokenize": post(DetokenizeRequest, "Turn token ids back into text", False),
        "/v1/models": get("The served model names"),
        "/tokenizer_info": get("The tokenizer's configuration (vLLM's shape)"),
        "/health": get("200 when ready, 503 while loading or after the engine died", None),
        "/ping": {**get("Same as /health (vLLM's)", None),
                  "post": get("Same as /health (vLLM's)", None)["get"]},
        "/version": get("The jaxserve version"),
        "/metrics": get("Prometheus metrics (text exposition format)", None),
    }
    return {"openapi": "3.1.0",
            "info": {"title": "jaxserve OpenAI-compatible API", "version": version},
            "paths": paths, "components": {"schemas": components}}
