"""The model's generation_config.json (or a GGUF's general.sampling.* keys) gives the defaults of
the request fields a request leaves unset, as vLLM's `--generation-config auto` does: offline
(`LLM.generate`/`chat` without SamplingParams), on the server (completions, chat, batch) and at
start-up in the log; a request's own fields win; `--generation-config vllm` ignores the file, a
folder replaces it and `--override-generation-config` merges over it.

The tiny dummy model's file sets top_k 1, so sampling with its defaults is greedy: outputs that
took them equal greedy outputs (with the file's repetition penalty), whatever the temperature."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.loader.generation_config import default_sampling_params

TINY = json.loads((Path(__file__).parent / "data" / "tiny-llama" / "config.json").read_text())
FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.7,
        "top_p": 0.9, "top_k": 1, "min_p": 0.01, "repetition_penalty": 1.3, "max_new_tokens": 5}
DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "top_k": 1, "min_p": 0.01,
            "repetition_penalty": 1.3, "max_tokens": 5}
ENGINE = dict(load_format="dummy", seed=1, max_model_len=64, kv_cache_memory_bytes=8 << 20,
              warmup=False)
PROMPTS = [{"prompt_token_ids": [5, 17, 300, 42]}, {"prompt_token_ids": [9, 8, 7]}]
GREEDY = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=5)


def _write(folder: Path, generation_config: dict | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("gencfg"), FILE)


@pytest.fixture(scope="module")
def tiny(model_dir):
    with LLM(model=str(model_dir), **ENGINE) as llm:
        yield llm


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# -- reading the defaults -------------------------------------------------------------------------
def test_auto_reads_the_sampling_fields_of_the_model_dir(model_dir, tmp_path):
    assert default_sampling_params("auto", model_dir) == (
        DEFAULTS, str(model_dir / "generation_config.json"))
    assert default_sampling_params("vllm", model_dir) == ({}, None)
    assert default_sampling_params("auto", _write(tmp_path / "bare", None)) == ({}, None)
    other = _write(tmp_path / "other", {"temperature": 0.2})
    assert default_sampling_params(str(other), model_dir)[0] == {"temperature": 0.2}
    merged, origin = default_sampling_params("auto", model_dir, {"temperature": 0.5,
                                                                 "max_new_tokens": 9})
    assert merged == {**DEFAULTS, "temperature": 0.5, "max_tokens": 9}
    assert origin.endswith("+ override_generation_config")
    assert default_sampling_params("vllm", model_dir, {"top_k": 3})[0] == {"top_k": 3}


def test_bad_generation_configs_are_value_errors_naming_the_field(model_dir, tmp_path):
    from jaxserve.config import EngineArgs
    with pytest.raises(ValueError, match="generation_config: .* is not a folder holding"):
        default_sampling_params(str(tmp_path / "missing"), model_dir)
    bad = _write(tmp_path / "bad", {"temperature": -1.0})
    with pytest.raises(ValueError, match="generation config .*temperature"):
        default_sampling_params("auto", bad)
    with pytest.raises(ValueError, match=r"override_generation_config has unknown key\(s\) "
                                         r"\['max_tokens'\]"):
        EngineArgs(override_generation_config={"max_tokens": 3})
    with pytest.raises(ValueError, match="generation_config must be"):
        EngineArgs(generation_config="")


def test_gguf_general_sampling_keys_are_the_gguf_generation_config(tmp_path):
    """llama.cpp's converter writes a model's recommended sampling as general.sampling.*; the
    default model's GGUF has none, so it keeps vLLM's defaults."""
    import gguf

    from jaxserve.default_model import default_model_path
    from jaxserve.loader.gguf import read_gguf
    path = tmp_path / "sampling.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_float32("general.sampling.temp", 0.6)
    writer.add_uint32("general.sampling.top_k", 20)
    writer.add_float32("general.sampling.top_p", 0.95)
    writer.add_float32("general.sampling.penalty_repeat", 1.25)
    writer.add_uint32("general.sampling.mirostat", 0)           # no such field here: ignored
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    defaults, origin = default_sampling_params("auto", path, gguf_reader=read_gguf(str(path)))
    assert defaults == pytest.approx({"temperature": 0.6, "top_k": 20, "top_p": 0.95,
                                      "repetition_penalty": 1.25})
    assert origin == f"{path} (general.sampling.*)"
    smollm = default_model_path()
    assert default_sampling_params("auto", smollm, gguf_reader=read_gguf(str(smollm))) == ({}, None)


# -- offline ----------------------------------------------------------------------------------------
def test_generate_without_sampling_params_uses_the_models_defaults(tiny):
    got = tiny.get_default_sampling_params()
    assert {k: getattr(got, k) for k in DEFAULTS} == DEFAULTS
    outs = tiny.generate(PROMPTS, use_tqdm=False)
    assert _ids(outs) == _ids(tiny.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert all(len(ids) == 5 for ids in _ids(outs))                  # max_new_tokens
    # explicit SamplingParams are taken as they are (vLLM's defaults for what they leave out)
    explicit = tiny.generate(PROMPTS, SamplingParams(max_tokens=3, seed=0), use_tqdm=False)
    assert all(len(ids) == 3 for ids in _ids(explicit))


def test_generation_config_vllm_ignores_the_file_and_override_still_applies(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="jaxserve"), \
            LLM(model=str(model_dir), generation_config="vllm",
                override_generation_config={"max_new_tokens": 3}, **ENGINE) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(max_tokens=3)
        assert all(len(ids) <= 3 for ids in _ids(llm.generate(PROMPTS, use_tqdm=False)))
    # the start-up log says which defaults apply and where they come from
    assert "default sampling parameters from override_generation_config: {'max_tokens': 3}" \
        in caplog.text


# -- server: completions, chat and batch build their SamplingParams over the defaults -----------
def test_request_fields_win_over_the_defaults():
    from jaxserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
    msgs = [{"role": "user", "content": "hi"}]
    for request in (CompletionRequest(prompt="x"), ChatCompletionRequest(messages=msgs)):
        p = request.to_sampling_params(100, DEFAULTS)
        assert {k: getattr(p, k) for k in DEFAULTS} == DEFAULTS
    p = CompletionRequest(prompt="x", temperature=0.2, top_k=4, repetition_penalty=1.0,
                          max_tokens=9).to_sampling_params(100, DEFAULTS)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens, p.top_p, p.min_p) == \
        (0.2, 4, 1.0, 9, 0.9, 0.01)
    p = ChatCompletionRequest(messages=msgs, max_completion_tokens=50, top_p=1.0,
                              min_p=0.0).to_sampling_params(100, DEFAULTS)
    assert (p.max_tokens, p.top_p, p.min_p, p.temperature) == (50, 1.0, 0.0, 0.7)
    # an unset max_tokens is the smallest of the room left, the request model's default (16
    # for completions) and max_new_tokens, as vLLM's get_max_tokens
    big = {"max_tokens": 40}
    assert ChatCompletionRequest(messages=msgs).to_sampling_params(100, big).max_tokens == 40
    assert ChatCompletionRequest(messages=msgs).to_sampling_params(30, big).max_tokens == 30
    assert CompletionRequest(prompt="x").to_sampling_params(100, big).max_tokens == 16
    assert CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(100, big) \
        .max_tokens == 40
    assert CompletionRequest(prompt="x").to_sampling_params(100, {}).temperature == 1.0


def test_server_requests_take_the_models_defaults(tiny):
    """Completions, chat and a batch line through the server's OpenAIServing on the tiny
    engine: fields left unset follow the file (greedy through top_k 1, 5 tokens)."""
    from test_server_faults import _Borrowed

    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.server.batch.runner import engine_routes
    from jaxserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
    from jaxserve.server.openai.serving import OpenAIServing
    prompt = "t5 t17 t300 t42"
    greedy = tiny.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"

    async def main():
        llm = AsyncLLM(engine=_Borrowed(tiny.llm_engine))
        await llm.start()
        try:
            serving = OpenAIServing(llm, ["tiny"])
            plain = await serving.create_completion(CompletionRequest(prompt=prompt))
            chat = await serving.create_chat_completion(ChatCompletionRequest(
                messages=[{"role": "user", "content": prompt}], chat_template=template))
            short = await serving.create_completion(CompletionRequest(prompt=prompt,
                                                                      max_tokens=2))
            batch = await engine_routes(serving)["/v1/completions"]({"prompt": prompt})
            return plain, chat, short, batch
        finally:
            await llm.shutdown()

    plain, chat, short, batch = asyncio.run(main())
    for body, text in ((plain, plain["choices"][0]["text"]),
                       (chat, chat["choices"][0]["message"]["content"]),
                       (batch, batch["choices"][0]["text"])):
        assert body["usage"]["completion_tokens"] == 5
        assert text == greedy.text
    assert short["usage"]["completion_tokens"] == 2


def test_cli_flags_reach_engine_args(tmp_path):
    from jaxserve.server.cli.flags import engine_args_from
    from jaxserve.server.cli.main import build_parser
    ns = build_parser().parse_args(["serve", "--generation-config", "vllm",
                                    "--override-generation-config", '{"temperature": 0.5}'])
    args = engine_args_from(ns)
    assert args.generation_config == "vllm"
    assert args.override_generation_config == {"temperature": 0.5}
    assert engine_args_from(build_parser().parse_args(["serve"])).generation_config == "auto"


def test_jaxserve_serve_applies_and_logs_the_defaults(model_dir, tiny):
    """A real `jaxserve serve` on the tiny model: the start-up log names the defaults, and a
    request with no sampling fields gets them; its own max_tokens wins."""
    import openai
    from server_fixtures import ServerProcess
    greedy = tiny.generate("t5 t17 t300 t42", GREEDY, use_tqdm=False)[0].outputs[0].text
    srv = ServerProcess(str(model_dir), "--load-format", "dummy", "--seed", "1", "--max-model-len", "64",
                        "--max-num-seqs", "4", "--max-num-batched-tokens", "32").start()
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
        plain = client.completions.create(model=str(model_dir), prompt="t5 t17 t300 t42")
        short = client.completions.create(model=str(model_dir), prompt="t5 t17 t300 t42",
                                          max_tokens=2)
        log = srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    assert f"default sampling parameters from {model_dir / 'generation_config.json'}" in log
    assert plain.usage.completion_tokens == 5 and plain.choices[0].text == greedy
    assert short.usage.completion_tokens == 2


def test_eos_token_ids_of_the_generation_config_end_generation(tiny, tmp_path):
    """Llama 3 Instruct lists <|eot_id|> only in generation_config.json's eos_token_id: as in
    vLLM, those ids stop generation besides config.json's, also with --generation-config vllm."""
    first = tiny.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "length" and len(first.token_ids) == 5
    stop_id = first.token_ids[1]
    assert stop_id not in first.token_ids[:1] and stop_id != 2
    folder = _write(tmp_path / "eos", {**FILE, "eos_token_id": [2, stop_id]})
    for source in ("auto", "vllm"):
        with LLM(model=str(folder), generation_config=source, **ENGINE) as llm:
            out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == list(first.token_ids[:2]), source
        assert out.finish_reason == "stop", source
