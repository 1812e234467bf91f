"""OpenAI protocol models (pydantic v2) shared by the HTTP server and the offline batch runner.

Request fields keep the order of the OpenAI API reference, followed by vLLM's extra sampling
fields. Unknown fields are accepted (`extra="allow"`) and logged, as vLLM does. Each request
builds its `SamplingParams` with `to_sampling_params(default_max_tokens, ...)`; range checks stay
in `SamplingParams` so every entry point reports the same message.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from jaxserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxserve.server.openai.tool_choice import tool_choice_schema

logger = logging.getLogger("jaxserve.server")


class OpenAIError(Exception):
    """A failure reported to the client as `{"error": {"message", "type", "param", "code"}}`."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, type: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or self.TYPES.get(status, "BadRequestError")
        self.param = param

    def to_dict(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.status)).model_dump()


MAX_JSON_DEPTH = 32   # deeper bodies are refused before pydantic or a chat template sees them


def check_json_body(data: Any) -> None:
    """Refuse what JSON allows but no request needs: nesting deeper than MAX_JSON_DEPTH, and
    strings that are not valid Unicode text (a lone surrogate such as "\\ud800" cannot be
    encoded as UTF-8, so the tokenizer could not take it). Raises a 400 OpenAIError naming the
    field. Iterative, so a hostile body cannot exhaust the stack."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise OpenAIError(400, f"The request body is nested more than {MAX_JSON_DEPTH} levels "
                                   "deep", param=path or None)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise OpenAIError(400, "Strings must be valid Unicode text (found a lone UTF-16 "
                                       f"surrogate) (field: {path})", param=path or None) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path, depth + 1))
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                stack.append((item, f"{path}.{i}" if path else str(i), depth + 1))


def validate_request(model_cls: type[BaseModel], data: dict) -> BaseModel:
    """Validate a request body; a pydantic failure becomes a 400 OpenAIError naming the field.
    Shared by the HTTP server and run-batch so both reject the same bodies the same way."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "__root__")
        msg = first.get("msg", str(e))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        raise OpenAIError(400, f"{msg} (field: {loc})" if loc else msg,
                          param=loc or None) from None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class OpenAIBaseModel(BaseModel):
    # Unknown fields are kept (vLLM accepts them) and logged once per request.
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _log_extra_fields(self):
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           sorted(self.model_extra))
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _SamplingFields(OpenAIBaseModel):
    """vLLM's extra sampling fields, accepted by both completion and chat requests."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    add_special_tokens: bool | None = None
    priority: int = 0
    request_id: str | None = None
    # Structured output: vLLM's field, and its older guided_* spellings (aliases).
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None

    # Beam search's fields: this engine has no beam search, so a request that asks for it (or
    # for its length penalty) is refused rather than answered by sampling as if it had not.
    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool) -> bool:
        if value:
            raise ValueError("beam search is not supported by this server; leave "
                             "use_beam_search false")
        return value

    @field_validator("length_penalty")
    @classmethod
    def _no_length_penalty(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("length_penalty only applies to beam search, which this server does "
                             f"not support; it must be 1.0, got {value}")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_range(cls, value: int | None) -> int | None:
        if value is not None and (value == 0 or value < -1):
            raise ValueError("truncate_prompt_tokens must be an integer >= 1 or -1 (the model's "
                             f"maximum context length), got {value}")
        return value

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The request's StructuredOutputsParams (ValueError naming the field when it is
        malformed or when two forms are given)."""
        forms = []
        if self.structured_outputs is not None:
            try:
                forms.append(("structured_outputs",
                              StructuredOutputsParams(**self.structured_outputs)))
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from None
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")}
        guided = {k: v for k, v in guided.items() if v is not None}
        if guided:
            names = ", ".join(f"guided_{k}" for k in guided)
            try:
                forms.append((names, StructuredOutputsParams(
                    **guided, whitespace_pattern=self.guided_whitespace_pattern)))
            except ValueError as e:
                raise ValueError(f"{e} (fields: {names})") from None
        forms.extend(self._response_format())
        if len(forms) > 1:
            raise ValueError("give one of structured_outputs, guided_* and response_format, "
                             f"not several (got {', '.join(f for f, _ in forms)})")
        return forms[0][1] if forms else None

    def _response_format(self) -> list[tuple[str, StructuredOutputsParams]]:
        return []

    def _check_stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return self

    def _sampling(self, *, defaults: dict[str, Any], max_tokens: int, logprobs: int | None,
                  stream: bool, temperature: float | None, top_p: float | None, n: int | None,
                  presence_penalty, frequency_penalty, seed, stop, logit_bias,
                  prompt_logprobs: int | None) -> SamplingParams:
        """`defaults`: the model's generation-config values (SamplingParams names) for the
        fields this request leaves unset (vLLM's default_sampling_params)."""
        def unset(name: str, value):
            return defaults.get(name) if value is None else value
        return SamplingParams.from_optional(
            n=n, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            repetition_penalty=unset("repetition_penalty", self.repetition_penalty),
            temperature=unset("temperature", temperature), top_p=unset("top_p", top_p),
            top_k=unset("top_k", self.top_k), min_p=unset("min_p", self.min_p), seed=seed, stop=stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=logit_bias,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self._structured_outputs())


class CompletionRequest(_SamplingFields):
    # OpenAI fields, in the order of https://platform.openai.com/docs/api-reference/completions
    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    best_of: int | None = None
    echo: bool | None = False
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    presence_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _validate(self):
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        return self._check_stream_options()

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt and its logprobs, no completion (what
        log-likelihood evaluation harnesses send). As vLLM, the engine generates one token, which
        the response leaves out."""
        return bool(self.echo) and self.max_tokens == 0

    def to_sampling_params(self, default_max_tokens: int,
                           default_sampling_params: dict[str, Any] | None = None) -> SamplingParams:
        """default_max_tokens: what is left of max_model_len after the prompt;
        default_sampling_params: the model's generation-config defaults (a max_tokens there
        caps an unset max_tokens, as vLLM's min rule does)."""
        defaults = default_sampling_params or {}
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        if (self.max_tokens is None or "max_tokens" not in self.model_fields_set) \
                and defaults.get("max_tokens") is not None:
            max_tokens = min(max_tokens, defaults["max_tokens"])
        if self.echo_only:
            max_tokens = 1
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs   # echo shows the prompt's logprobs too
        return self._sampling(defaults=defaults, max_tokens=max_tokens, logprobs=self.logprobs,
                              stream=bool(self.stream), temperature=self.temperature,
                              top_p=self.top_p, n=self.n, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, seed=self.seed,
                              stop=self.stop, logit_bias=self.logit_bias,
                              prompt_logprobs=prompt_logprobs)


class ChatCompletionRequest(_SamplingFields):
    # OpenAI fields, in the order of https://platform.openai.com/docs/api-reference/chat/create
    messages: list[dict[str, Any]]
    model: str | None = None
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None   # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = None
    n: int | None = 1
    presence_penalty: float | None = 0.0
    response_format: dict[str, Any] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"   # "auto" when tools are given without it
    parallel_tool_calls: bool | None = True
    user: str | None = None
    # vLLM's chat extras
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_tool_choice(cls, data):
        # vLLM: tools without tool_choice mean "auto"
        if isinstance(data, dict) and "tool_choice" not in data and data.get("tools"):
            data = {**data, "tool_choice": "auto"}
        return data

    @model_validator(mode="after")
    def _validate(self):
        check_tools(self.tools, self.tool_choice)
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError("`top_logprobs` must be a positive value.")
        return self._check_stream_options()

    def _response_format(self) -> list[tuple[str, StructuredOutputsParams]]:
        """OpenAI's response_format: text (no constraint), json_object, json_schema
        ({name, schema, strict}; strict forbids properties the schema does not name), or vLLM's
        structural_tag."""
        rf = self.response_format
        if rf is None:
            return []
        fmt = rf.get("type", "text")
        if fmt == "text":
            return []
        if fmt == "json_object":
            return [("response_format", StructuredOutputsParams(json_object=True))]
        if fmt == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise ValueError("response_format.json_schema must be an object with 'name' and "
                                 "'schema'")
            schema = spec.get("schema")
            if schema is None:
                return [("response_format", StructuredOutputsParams(json_object=True))]
            if not isinstance(schema, dict):
                raise ValueError("response_format.json_schema.schema must be a JSON schema "
                                 f"object, got {type(schema).__name__}")
            return [("response_format", StructuredOutputsParams(
                json=schema, disable_additional_properties=bool(spec.get("strict"))))]
        if fmt == "structural_tag":
            return [("response_format", StructuredOutputsParams(structural_tag=json.dumps(rf)))]
        raise ValueError(f"response_format type {fmt!r} is not supported; use 'text', "
                         "'json_object', 'json_schema' or 'structural_tag'")

    @property
    def named_tool(self) -> str | None:
        """The function name of a named tool_choice."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) \
            else None

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice not in (None, "none")

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template: `chat_template_kwargs`, and `reasoning_effort`
        when given (as vLLM: the field wins over a `reasoning_effort` in chat_template_kwargs; when
        neither sets it the variable stays undefined, so `{% if reasoning_effort is defined %}`
        templates pick their own default)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def to_sampling_params(self, default_max_tokens: int,
                           default_sampling_params: dict[str, Any] | None = None) -> SamplingParams:
        defaults = default_sampling_params or {}
        asked = self.requested_max_tokens()
        max_tokens = default_max_tokens if asked is None else asked
        if asked is None and defaults.get("max_tokens") is not None:
            max_tokens = min(max_tokens, defaults["max_tokens"])
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling(defaults=defaults, max_tokens=max_tokens, logprobs=logprobs,
                                stream=bool(self.stream), temperature=self.temperature,
                                top_p=self.top_p, n=self.n,
                                presence_penalty=self.presence_penalty,
                                frequency_penalty=self.frequency_penalty, seed=self.seed,
                                stop=self.stop, logit_bias=self.logit_bias,
                                prompt_logprobs=self.prompt_logprobs)
        # tool_choice "required" or a named function: the output is constrained to a valid call
        schema = tool_choice_schema(self.tool_choice, self.tools or [],
                                    self.parallel_tool_calls is not False) \
            if self.uses_tools else None
        if schema is not None:
            if params.structured_outputs is not None:
                raise ValueError("You can only either use structured outputs or tools, not both.")
            # compact JSON, as OpenAI writes arguments: a small model cannot loop on whitespace
            params.structured_outputs = StructuredOutputsParams(json=schema,
                                                                disable_any_whitespace=True)
        return params


_TOOL_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


def check_tools(tools: list[dict[str, Any]] | None, tool_choice) -> None:
    """`tools` and `tool_choice` as vLLM validates them (its messages), plus the shape of each
    tool, so a malformed tool is a 400 naming it rather than a failure in the chat template."""
    if tools is not None:
        if not tools:
            raise ValueError("`tools` must not be an empty array. Either provide at least one "
                             "tool or omit the field entirely.")
        for i, tool in enumerate(tools):
            fn = tool.get("function")
            if tool.get("type", "function") != "function" or not isinstance(fn, dict):
                raise ValueError(f"tools.{i} must be {{\"type\": \"function\", \"function\": "
                                 "{\"name\": ..., \"parameters\": {...}}}")
            if not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError(f"tools.{i}.function.name must be a non-empty string")
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise ValueError(f"tools.{i}.function.parameters must be a JSON schema object")
    if tool_choice in (None, "none"):
        return
    if tools is None:
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    if tool_choice in ("auto", "required"):
        return
    if not isinstance(tool_choice, dict):
        raise ValueError(f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, "
                         '"none", "auto" or "required" are supported.')
    function = tool_choice.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                         f"{_TOOL_USAGE}")
    if "name" not in function:
        raise ValueError(f"Expected field `name` in `function` in `tool_choice`! {_TOOL_USAGE}")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                         f"{_TOOL_USAGE}")
    if not any(t["function"]["name"] == name for t in tools):
        raise ValueError("The tool specified in `tool_choice` does not match any of the "
                         "specified `tools`")


class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of `prompt` or `messages` must be given")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: dict[str, int] | None = None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    details = None if cached_tokens is None else {"cached_tokens": cached_tokens}
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=details).model_dump()


def model_card(name: str, root: str, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "jaxserve",
            "root": root, "parent": None, "max_model_len": max_model_len}


Object = Literal["text_completion", "chat.completion", "chat.completion.chunk"]
