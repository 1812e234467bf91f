"""Every `vllm serve` command line of the reference guides (tests/data/vllm_seed_commands.txt) works as a
`jaxserve serve` command line: `vllm` renamed, the model swapped for a local tiny one of its kind (Qwen3,
Qwen3-MoE, Mixtral, Llama; AWQ / GPTQ int4 where the line quantises so; the default GGUF for `model.gguf`).
Each line either runs or fails at once with a message that names one of its flags and says why.

Every line goes through the real parser, the compatibility layer, EngineArgs' validation and the model
config checks the engine makes (config.json with --hf-overrides / --rope-scaling merged, the context limit,
the quantization method) in-process; a representative few start a real server, answer one request and
stop (`test_representative_seed_lines_serve_a_request`).
"""

from __future__ import annotations

import io
import json
import re
import shlex
import urllib.request
from contextlib import redirect_stderr
from pathlib import Path

import pytest

from jaxserve.loader.loader import fp8_scheme_of, load_hf_config
from jaxserve.server.cli import compat
from jaxserve.server.cli import main as cli
from jaxserve.server.cli.flags import check_tool_arguments, engine_args_from

DATA = Path(__file__).parent / "data" / "vllm_seed_commands.txt"


def _seed_lines() -> list[tuple[str, str]]:
    rows = [line.split("\t", 1) for line in DATA.read_text().splitlines() if line and not line.startswith("#")]
    return [(source, command) for source, command in rows]


SEEDS = _seed_lines()
# Lines refused, and the flag each refusal names (every other line must run).
REFUSED = {
    "001_c69dbfc57f34f86b.txt:321": "--quantization",                     # bitsandbytes
    "001_c69dbfc57f34f86b.txt:417": "--tool-call-parser",                 # glm47
    "001_c69dbfc57f34f86b.txt:424": "--tool-call-parser",                 # step3p5
    "001_c69dbfc57f34f86b.txt:698": "--pipeline-parallel-size",
    "001_c69dbfc57f34f86b.txt:745": "--pipeline-parallel-size",
    "001_c69dbfc57f34f86b.txt:759": "--speculative-model",
    "001_c69dbfc57f34f86b.txt:762": "speculative_config.method",          # step3p5_mtp
    "001_c69dbfc57f34f86b.txt:817": "--limit-mm-per-prompt",
    "001_c69dbfc57f34f86b.txt:928": "--reasoning-parser",                 # step3p5
    "001_c69dbfc57f34f86b.txt:1136": "--tool-call-parser",                # glm47
    "001_c69dbfc57f34f86b.txt:1170": "--reasoning-parser",                # step3p5
    "002_e2d129ceae207686.txt:75": "--pipeline-parallel-size",
}

_SMALL = dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=8, head_dim=16, intermediate_size=256)
_KINDS = {      # kind -> (transformers config class, config kwargs)
    "llama": ("LlamaConfig", dict(_SMALL, max_position_embeddings=131072)),
    "qwen3": ("Qwen3Config", dict(_SMALL, max_position_embeddings=40960)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(_SMALL, max_position_embeddings=40960, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=64)),
    "mixtral": ("MixtralConfig", dict(_SMALL, max_position_embeddings=32768, num_local_experts=8,
                                      num_experts_per_tok=2)),
}


def _add_tokenizer(path: Path) -> None:
    """The synthetic word-level tokenizer ("t5 t17" <-> [5, 17]) of the model's vocabulary."""
    from jaxserve.tokenizer.tokenizer import Tokenizer
    cfg = json.loads((path / "config.json").read_text())
    eos = cfg.get("eos_token_id") or 2
    (path / "tokenizer.json").write_text(Tokenizer.synthetic(cfg["vocab_size"], eos).backend.to_str())
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"t{eos}", "unk_token": "t0"}))


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from test_int4 import write_int4_checkpoint
    from test_model_parity import build_tiny_checkpoint
    root = tmp_path_factory.mktemp("seed-models")
    out = {}
    for kind, (config_class, kwargs) in _KINDS.items():
        build_tiny_checkpoint(root / kind, config_class, kwargs)
        out[kind] = root / kind
    for method in ("awq", "gptq"):
        write_int4_checkpoint(root / method, method, 32, False, False, kwargs=_KINDS["llama"][1])
        out[method] = root / method
    for path in out.values():
        _add_tokenizer(path)
    # an EAGLE-3 head (random, the published format) for the tiny Llama: the eagle3 line's model
    import jax

    from jaxserve.models import eagle3
    ecfg = eagle3.config_for(load_hf_config(out["llama"]))
    eagle3.save(root / "eagle3-head", ecfg, eagle3.init(ecfg, jax.random.key(0)))
    out["eagle3-head"] = root / "eagle3-head"
    from jaxserve.default_model import default_model_path
    out["gguf"] = default_model_path()
    # --gguf-file names a file inside the model's repo: a directory holding the default GGUF by each such name
    out["gguf-dir"] = root / "gguf-dir"
    out["gguf-dir"].mkdir()
    for _, command in SEEDS:
        words = shlex.split(command)
        if "--gguf-file" in words:
            (out["gguf-dir"] / words[words.index("--gguf-file") + 1]).symlink_to(default_model_path())
    return {k: str(v) for k, v in out.items()}


def _kind(model: str, argv: list[str]) -> str:
    quantization = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--quantization"), None)
    if "--gguf-file" in argv:
        return "gguf-dir"
    if model.endswith(".gguf"):
        return "gguf"
    if quantization in ("awq", "gptq"):
        return quantization
    if "Mixtral" in model:
        return "mixtral"
    if "A22B" in model or "moe" in model.lower() or "Step-3.5" in model:
        return "qwen3-moe"
    return "qwen3" if "Qwen" in model else "llama"


def localize(command: str, models: dict[str, str]) -> list[str]:
    """`vllm serve MODEL ...` -> the arguments after `jaxserve serve`, MODEL swapped for a tiny local one."""
    words = shlex.split(command)
    assert words[:2] == ["vllm", "serve"], command
    argv = words[2:]
    at = argv.index("--model") + 1 if "--model" in argv else 0
    argv[at] = models[_kind(argv[at], argv)]
    if "--speculative-config" in argv:      # an EAGLE-3 head's Hub name -> the local head
        i = argv.index("--speculative-config") + 1
        spec = json.loads(argv[i])
        if spec.get("method") == "eagle3":
            argv[i] = json.dumps(dict(spec, model=models["eagle3-head"]))
    return argv


def check_line(argv: list[str]) -> str | None:
    """None when `jaxserve serve ARGV` passes everything the engine checks before it loads weights, else
    the error it stops with."""
    from jaxserve.loader.loader import _check_quantization_flag
    parser = cli.build_parser()
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            ns = compat.parse_command_line(parser, ["serve", *argv])
            cli.apply_config_file(ns, ns._subparser)
            compat.apply_or_exit(ns)
            check_tool_arguments(ns)
            args = engine_args_from(ns)
            if args.gguf_file:            # the file inside the (local) repo is what loads
                assert Path(args.model_location()).is_file(), args.model_location()
            path = Path(args.model_location())
            if path.is_dir():
                cfg = load_hf_config(path, args.model_overrides())
                cfg.resolve_max_model_len(args.max_model_len)
                _check_quantization_flag(args.quantization, fp8_scheme_of(path), path)
                spec = args.spec_config()
                if spec is not None and spec.method == "eagle3":      # the head fits the target
                    from jaxserve.models import eagle3
                    eagle3.read_config(spec.model, cfg)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1]
    except ValueError as e:
        return str(e)
    return None


def _names_a_flag_of(message: str, argv: list[str]) -> bool:
    flat = message.replace("-", "_")
    return any(a.startswith("--") and a[2:].split("=")[0].replace("-", "_") in flat for a in argv)


@pytest.mark.parametrize("source,command", SEEDS, ids=[s for s, _ in SEEDS])
def test_seed_line_runs_or_is_refused_naming_the_flag(tiny_models, source, command):
    argv = localize(command, tiny_models)
    error = check_line(argv)
    if source in REFUSED:
        assert error is not None, f"{source} was expected to be refused: {command}"
        assert REFUSED[source].lstrip("-").replace("-", "_") in error.replace("-", "_"), error
        assert _names_a_flag_of(error, argv), error
        assert len(error) > 60, f"no reason given: {error}"
    else:
        assert error is None, f"{source}: {command}\n-> {error}"


def test_seed_lines_tally():
    """The acceptance figure: every line runs or is refused with a reason, most run."""
    runs = len(SEEDS) - len(REFUSED)
    assert set(REFUSED) <= {s for s, _ in SEEDS}
    assert len(SEEDS) == 78 and runs == 66, (len(SEEDS), runs)


# A representative few, started for real: YaRN 131K on a MoE with EP over 2 devices, --enable-reasoning and
# --trust-remote-code; 4-way TP with n-gram speculation, prefix caching and an fp8 KV cache; --api-key with the
# JSON list of --allowed-origins; --cpu-offload-gb 10 (every stacked layer weight in host memory); 4-way TP with
# an EAGLE-3 head (a local one for the line's Hub name) and an fp8 KV cache.
SERVED = ["000_a5a415881538e937.txt:372", "000_a5a415881538e937.txt:349", "001_c69dbfc57f34f86b.txt:55",
          "001_c69dbfc57f34f86b.txt:164", "000_a5a415881538e937.txt:360"]
# Appended (the last value wins): a free local port instead of the line's 0.0.0.0:8000, and a small step budget
# and KV pool, so start-up compiles a few token buckets, not the dozens of a 16K-token budget.
HARNESS = ["--host", "127.0.0.1", "--max-num-batched-tokens", "32", "--max-num-seqs", "4",
           "--num-gpu-blocks-override", "64"]


@pytest.mark.slow
@pytest.mark.parametrize("source", SERVED)
def test_representative_seed_lines_serve_a_request(tiny_models, monkeypatch, tmp_path, source):
    from server_fixtures import ServerProcess
    command = dict(SEEDS)[source]
    argv = localize(command, tiny_models)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    server = ServerProcess(log_path=tmp_path / "server.log")
    server.args = [*server.args[:4], *argv, *HARNESS, "--port", str(server.port)]
    server.start(timeout=600)
    try:
        headers = {"Content-Type": "application/json"}
        if "--api-key" in argv:
            headers["Authorization"] = "Bearer " + argv[argv.index("--api-key") + 1]
        body = json.dumps({"model": argv[0], "prompt": "t5 t6 t7 t8", "max_tokens": 3}).encode()
        request = urllib.request.Request(server.base_url + "/v1/completions", body, headers)
        with urllib.request.urlopen(request, timeout=120) as r:
            out = json.loads(r.read())
        assert out["usage"]["completion_tokens"] >= 1, out
        if "eagle3" in command:       # /metrics has vLLM's speculative decoding counters
            with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
                metrics = r.read().decode()
            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                assert re.search(rf"^\w+:spec_decode_{name}_total\{{", metrics, re.M), (name, metrics)
    finally:
        assert server.stop() == 0, server.log()
    log = server.log()
    if "--trust-remote-code" in argv:       # one warning per no-op flag, naming it
        assert log.count("--trust-remote-code is accepted for vLLM command lines") == 1, log


def test_gguf_file_is_the_file_inside_the_model_directory_or_repo(tmp_path):
    from jaxserve.config import EngineArgs
    (tmp_path / "m.gguf").write_bytes(b"")
    assert EngineArgs(model=str(tmp_path), gguf_file="m.gguf").model_location() == str(tmp_path / "m.gguf")
    assert EngineArgs(model="TheBloke/Llama-2-70B-GGUF", gguf_file="llama-2-70b.Q4_K_M.gguf").model_location() \
        == "TheBloke/Llama-2-70B-GGUF/llama-2-70b.Q4_K_M.gguf"      # resolved as org/name/FILE.gguf
    for model, name, field in ((str(tmp_path / "m.gguf"), "m.gguf", "gguf_file"), (None, "m.gguf", "gguf_file"),
                               (str(tmp_path), "m.bin", "gguf_file")):
        with pytest.raises(ValueError, match=field):
            EngineArgs(model=model, gguf_file=name)
