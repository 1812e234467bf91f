"""The jaxserve CLI parser: vLLM flag names and groups, --config YAML, the subcommand registry."""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve.config import EngineArgs
from jaxserve.server.cli import main as cli
from jaxserve.server.cli.flags import _ENGINE_FLAGS, add_engine_args, engine_args_from
from jaxserve.server.cli.offline import generate_inputs


def parse(*argv):
    parser = cli.build_parser()
    ns = parser.parse_args(["serve", *argv])
    cli.apply_config_file(ns, ns._subparser)
    return ns


def test_every_engine_arg_has_a_flag():
    flagged = {name for name, _, _ in _ENGINE_FLAGS} | {"model"}
    assert flagged == set(EngineArgs.field_names())


def test_help_is_grouped_like_vllm():
    out = subprocess.run([sys.executable, "-m", "jaxserve.server.cli", "serve", "--help"],
                         capture_output=True, text=True, check=True).stdout
    for group in ("ModelConfig:", "CacheConfig:", "SchedulerConfig:", "ParallelConfig:",
                  "Frontend:"):
        assert group in out
    for flag in ("--max-model-len", "--tensor-parallel-size", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--speculative-config", "--kv-cache-memory-bytes",
                 "--num-gpu-blocks-override", "--compilation-cache-dir", "--max-waiting-requests",
                 "--api-key", "--served-model-name", "--config", "--attention-backend"):
        assert flag in out


def test_only_given_flags_override_engine_defaults():
    ns = parse("some/model.gguf", "--max-model-len", "1k", "--no-enable-prefix-caching",
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
               "-tp", "1", "--served-model-name", "a", "b")
    args = engine_args_from(ns)
    assert args.model == "some/model.gguf" and args.max_model_len == 1000
    assert args.enable_prefix_caching is False
    assert args.speculative_config["num_speculative_tokens"] == 3
    assert args.served_model_name == "a"
    assert args.block_size == EngineArgs().block_size


def test_config_yaml_fills_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("max-model-len: 256\nmax_num_seqs: 8\nport: 9001\nenable-prefix-caching: false\n")
    ns = parse("--config", str(cfg), "--max-model-len", "128")
    args = engine_args_from(ns)
    assert args.max_model_len == 128 and args.max_num_seqs == 8
    assert args.enable_prefix_caching is False and ns.port == 9001


def test_unknown_config_key_is_an_error(tmp_path):
    cfg = tmp_path / "config.yaml"
    cfg.write_text("max-model-lenn: 256\n")
    with pytest.raises(SystemExit):
        parse("--config", str(cfg))


def test_registered_subcommand_appears(monkeypatch):
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(cli.SUBCOMMANDS))
    cli.register_subcommand("run-batch", "Run a JSONL batch.",
                            lambda p: (p.add_argument("-i"), add_engine_args(p)),
                            lambda ns: 0)
    ns = cli.build_parser().parse_args(["run-batch", "-i", "in.jsonl", "--max-num-seqs", "4"])
    assert ns.command == "run-batch" and engine_args_from(ns).max_num_seqs == 4
    assert cli.main(["run-batch", "-i", "x"]) == 0


def test_generate_takes_the_model_as_a_flag_and_every_positional_as_a_prompt():
    parser = cli.build_parser()
    ns = parser.parse_args(["generate", "--model", "path/to/model.gguf", "Once upon a time",
                            "--max-model-len", "256"])
    args, prompts = generate_inputs(ns)
    assert (args.model, prompts, args.max_model_len) == ("path/to/model.gguf", ["Once upon a time"], 256)
    args, prompts = generate_inputs(parser.parse_args(["generate", "First", "Second"]))
    assert (args.model, prompts) == (None, ["First", "Second"])


def test_generate_refuses_a_model_path_given_as_the_first_prompt(capsys):
    tiny = str(Path(__file__).parent / "data" / "tiny-llama")
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", tiny, "Hello"])
    assert e.value.code == 2
    assert f"pass it as --model, e.g. jaxserve generate --model {tiny}" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_answers_each_prompt(capsys):
    tiny = str(Path(__file__).parent / "data" / "tiny-llama")
    flags = ["--model", tiny, "--load-format", "dummy", "--max-model-len", "32",
             "--max-num-batched-tokens", "16", "--kv-cache-memory-bytes", "4M", "--max-tokens", "3",
             "--compilation-cache-dir", ""]
    assert cli.main(["generate", *flags, "t5 t6", "t7 t8 t9"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(", Generated text: ")[0] for line in lines] == ["Prompt: 't5 t6'", "Prompt: 't7 t8 t9'"]
    for line in lines:      # the dummy model's synthetic tokenizer: words "t<id>" (eos may end it)
        words = ast.literal_eval(line.split(", Generated text: ")[1]).split()
        assert 1 <= len(words) <= 3 and all(re.fullmatch(r"t\d+", w) for w in words), line


def test_version_flag_prints_the_version(capsys):
    from jaxserve import __version__
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"jaxserve {__version__}"


def test_an_uncached_hub_name_offline_is_refused_naming_it(capsys, monkeypatch, tmp_path):
    """Hub names download (tests/test_hub.py); with HF_HUB_OFFLINE and an empty cache the
    refusal names the model and why."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct", "--download-dir",
                  str(tmp_path), "Hello"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "'HuggingFaceTB/SmolLM2-135M-Instruct'" in err and "HF_HUB_OFFLINE is set" in err


def _help_texts() -> dict[str, str]:
    """`jaxserve --help` and every subcommand's --help, as printed."""
    parser = cli.build_parser()
    texts = {"jaxserve": parser.format_help()}
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        texts[name] = p.format_help()
    return texts


def _flag_entries(text: str) -> list[str]:
    """Each option's help entry (its lines joined), from an argparse help text."""
    entries: list[str] = [""]
    for line in text.splitlines():
        if re.match(r"^ {2,4}\S", line):                  # an option, positional or subcommand
            entries.append(line.strip())
        elif re.match(r"^ {5,}\S", line) and entries[-1]:  # its wrapped help
            entries[-1] += " " + line.strip()
        else:                                              # a heading or blank line ends it
            entries.append("")
    return [e for e in entries if e]


def test_help_says_each_default_once_and_names_no_source_files():
    texts = _help_texts()
    assert {"serve", "generate", "run-batch", "export-model"} <= set(texts)
    for command, text in texts.items():
        for entry in _flag_entries(text):
            assert entry.count("(default") <= 1, f"{command}: {entry}"
        assert not re.search(r"[\w/]+\.py\b", text), f"{command} --help names a source file"
    serve = " ".join(_flag_entries(texts["serve"]))
    assert "(default: ~/.cache/jaxserve/xla)" in serve and "(default: None)" not in serve


def test_the_start_up_configuration_is_one_block_of_non_default_settings():
    from jaxserve.server.cli.serve import describe_config
    from jaxserve.server.http.api_server import ServerArgs
    ns = parse("m.gguf", "--max-model-len", "512", "--served-model-name", "a", "b", "--port", "9000",
               "--api-key", "secret", "--reasoning-parser", "qwen3")
    engine_args = engine_args_from(ns)
    server_args = ServerArgs(port=9000, api_key="secret", served_model_name=["a", "b"],
                             reasoning_parser="qwen3")
    block = describe_config(engine_args, server_args)
    assert block.splitlines()[1:] == ["    served_model_name: a b", "    max_model_len: 512",
                                      "    reasoning_parser: qwen3", "    port: 9000", "    api_key: ***"]
    assert describe_config(engine_args_from(parse()), ServerArgs()) == " none"
