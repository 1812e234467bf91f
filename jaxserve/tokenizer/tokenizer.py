"""Tokenizer, chat templates, incremental detokenization and stop strings.

`Tokenizer` wraps a `tokenizers.Tokenizer` loaded from a Hugging Face directory (tokenizer.json +
tokenizer_config.json) or rebuilt from a GGUF file's metadata (see gguf_tokenizer.py). Chat
templates render with jinja2 in a sandbox set up like transformers' renderer, so prompts match
`AutoTokenizer.apply_chat_template` byte for byte.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas without ever splitting
a multi-byte character (vLLM's prefix_offset/read_offset technique). `check_stop_strings` and
`stop_buffer_length` implement vLLM's stop-string semantics.

Host side only: no jax, no torch.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as _BackendTokenizer

from jaxserve.tokenizer.gguf import build_gguf_tokenizer, read_gguf_tokenizer, set_bos_eos_post_processor

# Texts longer than this are encoded through encode_batch_fast, which releases the GIL while it
# works (encode does not), so a long prompt tokenized on a server worker thread leaves the event
# loop free; "fast" skips the character offsets nobody reads.
_GIL_FREE_ENCODE_CHARS = 16_384

# How many prompt tokens the detokenizer decodes as left context (vLLM: INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET).
_INITIAL_DETOKENIZATION_OFFSET = 5


def _token_content(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special-token and chat-template facts the engine needs."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        config: dict[str, Any] | None = None,
    ):
        """config: tokenizer_config.json as read (what /tokenizer_info reports), if any."""
        self.backend = backend
        self.config = dict(config or {})
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token

    # ---- loading ---------------------------------------------------------------------------------

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template from an HF model dir."""
        path = os.fspath(path)
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise ValueError(f"no tokenizer.json in {path!r}; only fast (tokenizers) tokenizers are supported")
        backend = _BackendTokenizer.from_file(tok_file)
        config = {}
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_file):
            with open(config_file, encoding="utf-8") as f:
                config = json.load(f)
        special = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}

        chat_template = config.get("chat_template")
        if isinstance(chat_template, list):  # [{"name": ..., "template": ...}]: the default one
            named = {t["name"]: t["template"] for t in chat_template}
            chat_template = named.get("default")
        jinja_file = os.path.join(path, "chat_template.jinja")
        json_file = os.path.join(path, "chat_template.json")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                chat_template = f.read()
        elif chat_template is None and os.path.isfile(json_file):
            with open(json_file, encoding="utf-8") as f:
                chat_template = json.load(f).get("chat_template")

        # The post-processor in tokenizer.json decides BOS; an explicit config flag overrides it
        # the way transformers' fast tokenizers rebuild their post-processor.
        bos_id = backend.token_to_id(special["bos_token"]) if special["bos_token"] else None
        adds_bos = bos_id is not None and backend.encode("a").ids[:1] == [bos_id]
        add_bos = config.get("add_bos_token")
        if add_bos is not None and bool(add_bos) != adds_bos and bos_id is not None:
            eos_id = backend.token_to_id(special["eos_token"]) if config.get("add_eos_token") else None
            set_bos_eos_post_processor(backend, bos_id if add_bos else None, eos_id)
            adds_bos = bool(add_bos)
        return cls(backend, **special, chat_template=chat_template, add_bos_token=adds_bos,
                   config=config)

    @classmethod
    def from_gguf(cls, path_or_reader) -> Tokenizer:
        """Rebuild the tokenizer described by a GGUF file (a path or an open `gguf.GGUFReader`)."""
        data = read_gguf_tokenizer(path_or_reader)
        backend = build_gguf_tokenizer(data)

        def name(token_id):
            return data.tokens[token_id] if token_id is not None and 0 <= token_id < len(data.tokens) else None

        add_bos = data.add_bos_token if data.add_bos_token is not None else data.model == "llama"
        return cls(
            backend, bos_token=name(data.bos_token_id), eos_token=name(data.eos_token_id),
            unk_token=name(data.unk_token_id), pad_token=name(data.pad_token_id),
            chat_template=data.chat_template, add_bos_token=add_bos,
        )

    @classmethod
    def synthetic(cls, vocab_size: int, eos_token_id: int | None = None) -> Tokenizer:
        """A word-level tokenizer whose tokens are "t0" .. "t{vocab_size-1}" (id i is "t{i}"),
        for `--load-format dummy` models that ship only a config.json: text prompts such as
        "t17 t42" encode to [17, 42], unknown words to 0, and outputs decode to such words."""
        from tokenizers import models, pre_tokenizers
        backend = _BackendTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)},
                                                     unk_token="t0"))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        eos = None if eos_token_id is None else f"t{eos_token_id}"
        return cls(backend, eos_token=eos, unk_token="t0",
                   chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}")

    @classmethod
    def from_model(cls, model: str | os.PathLike) -> Tokenizer:
        """`model` is a .gguf file or an HF directory."""
        model = os.fspath(model)
        if os.path.isfile(model) and model.endswith(".gguf"):
            return cls.from_gguf(model)
        return cls.from_pretrained_dir(model)

    # ---- vocabulary facts ------------------------------------------------------------------------

    def _id(self, token: str | None) -> int | None:
        return self.backend.token_to_id(token) if token is not None else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def all_special_ids(self) -> list[int]:
        """Every added token marked special, plus the bos/eos/unk/pad ids."""
        ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        named = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        ids |= {i for i in named if i is not None}
        return sorted(ids)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    # ---- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)  # < 0.21
            (encoding,) = batch([text], add_special_tokens=add_special_tokens)
            return encoding.ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """Raw vocabulary pieces (e.g. "Ġthe"), not text."""
        return [self.backend.id_to_token(i) or "" for i in ids]

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]:
        return [self.backend.token_to_id(t) for t in tokens]

    def decode_token(self, token_id: int) -> str:
        """The text of one token, as vLLM shows it in logprobs' `decoded_token` (partial bytes of a
        multi-byte character come out as U+FFFD)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    # ---- chat templates --------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Render `messages` like transformers' `apply_chat_template`; `tokenize=True` returns ids
        encoded without adding special tokens (the template writes them)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                "this model has no chat template (none in tokenizer_config.json, chat_template.jinja, "
                "chat_template.json or the GGUF tokenizer.chat_template key); pass chat_template= or use a "
                "completion prompt instead"
            )
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        messages = prepare_messages(messages)
        context = {
            "bos_token": self.bos_token, "eos_token": self.eos_token,
            "unk_token": self.unk_token, "pad_token": self.pad_token,
            "documents": None, **kwargs,
        }
        rendered = _compile_template(template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
        )
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or final.strip() not in rendered:
                raise ValueError("continue_final_message is set but the final message is not in the rendered chat")
            end = rendered.rindex(final.strip()) + len(final.strip())
            rendered = rendered[:end]
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered


def prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant messages with `tool_calls` as chat templates expect them (vLLM does the same):
    each `function.arguments` JSON string becomes a dict (templates write `arguments | tojson` or
    iterate its items) and a null `content` becomes "". The caller's dicts are not changed."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and calls:
            fixed = []
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    raise ValueError(f"messages.{i}.tool_calls.{j}.function must be an object "
                                     "with 'name' and 'arguments'")
                args = fn.get("arguments")
                if isinstance(args, str) and args.strip():
                    try:
                        args = json.loads(args)
                    except ValueError as e:
                        raise ValueError(f"messages.{i}.tool_calls.{j}.function.arguments is "
                                         f"not valid JSON: {e}") from None
                elif not args:
                    args = {}
                fixed.append({**call, "function": {**fn, "arguments": args}})
            message = {**message, "tool_calls": fixed}
            if message.get("content") is None:
                message["content"] = ""
        out.append(message)
    return out


@lru_cache(maxsize=16)
def _compile_template(template: str):
    """A sandboxed jinja2 template with the same globals/filters as transformers' renderer."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


class IncrementalDetokenizer:
    """Text deltas for a growing output, never splitting a multi-byte character.

    Each step decodes the window `ids[prefix_offset:]` and subtracts the already-emitted window
    `ids[prefix_offset:read_offset]`; text ending in U+FFFD (an incomplete UTF-8 sequence) is held
    back until later tokens complete it. The last few prompt tokens are the initial left context,
    so a SentencePiece leading space or a byte-level continuation decodes as it would in place.

    With no prompt context (or a byte-level vocabulary), "".join(deltas) + flush() equals
    `tokenizer.decode(output_ids, skip_special_tokens)`. `spaces_between_special_tokens` is accepted
    for vLLM API parity; like vLLM's fast-tokenizer path, the tokenizers backend inserts no spaces.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        prompt = list(prompt_token_ids or ())
        self._ids = prompt[-_INITIAL_DETOKENIZATION_OFFSET:]  # left context + output, [prefix window..]
        self._num_prompt = len(self._ids)
        self.prefix_offset = 0
        self.read_offset = len(self._ids)
        self.output_token_ids: list[int] = []
        self.output_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_tokens(self, new_ids: list[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self._ids.extend(new_ids)
        self.output_token_ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # nothing yet, or a character still incomplete
        delta = new_text[len(prefix_text) :]
        # Drop ids left of the new prefix window: they never get decoded again.
        del self._ids[: self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self._ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: the held-back tail (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self.prefix_offset, self.read_offset = len(self._ids), len(self._ids)
        self.output_text += delta
        return delta


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """vLLM's stop-string check on the accumulated `output_text` after `new_char_count` new chars.

    Only the tail that could hold a newly completed stop string is searched. Returns None, or
    `(stop_str, truncate_to)`: cut the text to `output_text[:truncate_to]`; `truncate_to == -1`
    means keep all of it (the stop string is included and ends the text).
    """
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        stop_len = len(stop_str)
        index = output_text.find(stop_str, max(0, len(output_text) + 1 - new_char_count - stop_len))
        if index == -1:
            continue
        if include_stop_str_in_output:
            index += stop_len
            if index >= len(output_text):
                return stop_str, -1
        return stop_str, index
    return None


def stop_buffer_length(stop: list[str] | None, include_stop_str_in_output: bool) -> int:
    """Chars a stream must hold back so a partial stop string is never emitted (vLLM's rule)."""
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1


def next_stream_text(output_text: str, emitted: int, buffer_length: int, finished: bool) -> tuple[str, int]:
    """The text to stream now and the new emitted offset: everything after `emitted` except the
    last `buffer_length` chars, which stay back until the request finishes."""
    end = len(output_text) if finished else len(output_text) - buffer_length
    if end <= emitted:
        return "", emitted
    return output_text[emitted:end], end
