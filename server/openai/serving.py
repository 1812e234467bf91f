"""Endpoint logic of the OpenAI-compatible API, independent of HTTP.

`OpenAIServing(engine: AsyncLLM, served_model_names)` has one coroutine per endpoint taking a
validated request model. Non-streaming calls return the JSON body as a dict; streaming calls
return an async iterator of SSE strings (`"data: {...}\\n\\n"`, ending with `"data: [DONE]\\n\\n"`)
after the request has been accepted, so every validation failure is raised before the first
byte as an `OpenAIError` (400, 404, 503). The aiohttp routes (api_server.py) and the offline batch
runner both call these.

The endpoints live by job: serving_base.py (checks, queueing, the tokenizing threads),
serving_completions.py, serving_chat.py; this file joins them and adds the model list and the
tokenizer endpoints.
"""

from __future__ import annotations

from jaxserve.server.openai.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest, model_card
from jaxserve.server.openai.serving_base import _input_size
from jaxserve.server.openai.serving_chat import ChatServing
from jaxserve.server.openai.serving_completions import CompletionServing
from jaxserve.server.openai.templates import _flatten_content

__all__ = ["OpenAIServing", "OpenAIError"]


class OpenAIServing(CompletionServing, ChatServing):
    """Every endpoint: completions, chat completions, the model list and the tokenizer ones."""

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


def _plain(value):
    """tokenizer_config.json values as JSON: an AddedToken dict becomes its text."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str) and "lstrip" in value:
            return value["content"]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
