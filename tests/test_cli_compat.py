"""vLLM's spellings on the jaxserve command line (server/cli/compat.py, help_search.py): no-op flags accepted
with one warning each, aliases mapped, underscore flags, refused flags and typos named, --help=QUERY."""

from __future__ import annotations

import logging

import pytest

from jaxserve.server.cli import compat
from jaxserve.server.cli import main as cli
from jaxserve.server.cli.flags import engine_args_from


def parse(*argv: str):
    ns = compat.parse_command_line(cli.build_parser(), ["serve", "m", *argv])
    cli.apply_config_file(ns, ns._subparser)
    compat.apply_or_exit(ns)
    return ns


def error_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse(*argv)
    assert e.value.code == 2
    return capsys.readouterr().err


HARMLESS = [("--trust-remote-code",), ("--enforce-eager",), ("--disable-log-requests",), ("-O3",), ("-O.level=3",),
            ("-O.level", "3"), ("--compilation-config.level=3",), ("-O", '{"level": 3}'),
            ("--uvicorn-log-level", "debug"), ("--max-model-len", "auto"),
            ("--enable-reasoning",), ("--num-scheduler-steps", "5"), ("--pipeline-parallel-size", "1"),
            ("--load-format", "fastsafetensors"), ("--calculate-kv-scales",), ("--enable-eplb",)]


@pytest.mark.parametrize("flag", HARMLESS, ids=lambda f: " ".join(f))
def test_harmless_vllm_flag_is_accepted_with_one_warning_naming_it(caplog, flag):
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        ns = parse(*flag)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    name = "-O/--compilation-config" if flag[0].startswith(("-O", "--compilation-config")) else flag[0]
    assert name in warnings[0] and "does nothing here" in warnings[0]
    args = engine_args_from(ns)         # and the engine settings are the defaults'
    assert args == engine_args_from(parse())


def test_aliases_map_to_jaxserve_values_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        assert engine_args_from(parse("--dtype", "half")).dtype == "float16"
        assert engine_args_from(parse("--dtype=float")).dtype == "float32"
        assert engine_args_from(parse("--load-format", "safetensors")).load_format == "auto"
        assert parse("--allowed-origins", '["https://a.example", "https://b.example"]').allowed_origins == \
            ["https://a.example", "https://b.example"]
        assert parse("--allowed-origins", "https://a.example").allowed_origins == ["https://a.example"]
    assert not caplog.records


def test_underscore_spellings_are_the_dashed_flags():
    ns = parse("--max_model_len", "64", "--speculative_config", '{"method": "ngram"}', "--enable_prefix_caching",
               "--trust_remote_code")
    args = engine_args_from(ns)
    assert args.max_model_len == 64 and args.speculative_config == {"method": "ngram"}
    assert args.enable_prefix_caching is True


@pytest.mark.parametrize("typo,suggestion", [("--max-mdoel-len", "--max-model-len"),
                                             ("--trust-remote-cod", "--trust-remote-code"),
                                             ("--max_num_seq", "--max-num-seqs")])
def test_unknown_flag_fails_and_suggests_the_close_match(capsys, typo, suggestion):
    err = error_of(capsys, typo, "8")
    assert f"unrecognized arguments: {typo} (did you mean {suggestion}?)" in err


@pytest.mark.parametrize("argv,reason", [
    (("--limit-mm-per-prompt", "{}"), "argument --limit-mm-per-prompt: multimodal inputs are not supported"),
    (("--swap-space", "4"), "argument --swap-space: preempted requests are recomputed"),
    (("--pipeline-parallel-size", "2"), "pipeline parallelism is not supported"),
    (("--preemption-mode", "swap"), "never swapped"),
    (("--speculative-model", "x"), "--speculative-config"),
    (("--allowed-origins", "[1, 2]"), "--allowed-origins must be a JSON list of strings"),
    (("--hf-overrides", "[1]"), "argument --hf-overrides: must be a JSON object"),
])
def test_refused_flag_names_itself_and_why(capsys, argv, reason):
    assert reason in error_of(capsys, *argv)


def test_config_file_takes_vllm_flags_too(tmp_path, caplog, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("trust-remote-code: true\nmax_model_len: auto\nrope-scaling: '{\"rope_type\": \"linear\", "
                    "\"factor\": 2.0}'\n")
    with caplog.at_level(logging.WARNING, logger="jaxserve"):
        args = engine_args_from(parse("--config", str(good)))
    assert args.max_model_len is None and args.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert sum("--trust-remote-code" in r.getMessage() for r in caplog.records) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("swap-space: 4\n")
    assert "argument --swap-space: preempted requests are recomputed" in error_of(capsys, "--config", str(bad))


def _help(capsys, query: str) -> str:
    assert cli.main(["serve", f"--help={query}"]) == 0
    return capsys.readouterr().out


def test_help_listgroup_group_flag_and_keyword(capsys):
    groups = _help(capsys, "listgroup")
    assert "ModelConfig" in groups and "SchedulerConfig" in groups and "vLLM compatibility" in groups
    model = _help(capsys, "ModelConfig")
    assert model.startswith("ModelConfig:") and "--max-model-len" in model and "--max-num-seqs" not in model
    one = _help(capsys, "max-num-seqs")
    assert "--max-num-seqs" in one and "--max-model-len" not in one
    found = _help(capsys, "max")
    assert "--max-num-seqs" in found and "--max-model-len" in found and "--max-logprobs" in found
    assert "--host" not in found
    assert "--max-model-len" in _help(capsys, "context length")      # help text is searched too
    assert "--enforce-eager" in _help(capsys, "compatibility")        # and group titles
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help=nosuchthing"])
    assert "--help=nosuchthing: no argument group, flag or help text matches" in capsys.readouterr().err
