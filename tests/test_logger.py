"""`LLM()` is not silent in a plain script: jaxserve's INFO lines reach stderr unless the program
configured logging itself or set JAXSERVE_CONFIGURE_LOGGING=0."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

CODE = """
import logging, sys
{setup}
from jaxserve.logger import configure_default_logging
configure_default_logging()
logging.getLogger("jaxserve").info("loading weights")
"""


def _stderr(setup: str = "", **env) -> str:
    out = subprocess.run([sys.executable, "-c", CODE.format(setup=setup)], capture_output=True, text=True,
                         env=dict(os.environ, **env), check=True, timeout=60)
    return out.stderr


def test_info_lines_reach_stderr_by_default():
    assert "INFO" in _stderr() and "jaxserve: loading weights" in _stderr()


def test_off_switch_and_a_program_s_own_logging_config_win():
    assert _stderr(JAXSERVE_CONFIGURE_LOGGING="0") == ""
    own = _stderr(setup="logging.basicConfig(level=logging.WARNING, format='%(message)s')")
    assert own == ""


ENGINE = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from jaxserve.config import EngineArgs
from jaxserve.engine.llm_engine import LLMEngine
LLMEngine(EngineArgs(model=sys.argv[1], load_format="dummy", max_model_len=32, max_num_batched_tokens=16,
                     kv_cache_memory_bytes=4 << 20, compilation_cache_dir=sys.argv[2]))
"""


def test_start_up_says_loaded_from_the_compilation_cache_or_compiled(tmp_path):
    tiny = str(Path(__file__).parent / "data" / "tiny-llama")

    def start() -> list[str]:
        out = subprocess.run([sys.executable, "-c", ENGINE, tiny, str(tmp_path / "xla")], capture_output=True,
                             text=True, timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        assert out.returncode == 0, out.stderr[-3000:]
        return [line for line in out.stderr.splitlines() if "program" in line]

    cold, warm = start(), start()
    # token buckets 1, 2 and 16 for max_num_batched_tokens=16: 16 with and without prompt
    # logprobs, 1 and 2 without (worker/model_runner.py)
    steps = [line for line in cold if line.startswith("step program")]
    assert len(steps) == 4 and all(line.endswith("s)") and ", compiled (" in line for line in steps), cold
    assert "0 loaded from the compilation cache, 4 compiled" in cold[-1]
    steps = [line for line in warm if line.startswith("step program")]
    assert len(steps) == 4 and all(", loaded from the compilation cache (" in line for line in steps), warm
    assert "(4 model programs: 4 loaded from the compilation cache, 0 compiled)" in warm[-1]


def test_the_load_line_says_fp8_when_quantizing(caplog):
    from jaxserve.config import EngineArgs
    from jaxserve.engine.llm_engine import LLMEngine
    tiny = str(Path(__file__).parent / "data" / "tiny-llama")
    with caplog.at_level(logging.INFO, logger="jaxserve"):
        engine = LLMEngine(EngineArgs(model=tiny, load_format="dummy", quantization="fp8", max_model_len=32,
                                      kv_cache_memory_bytes=4 << 20), warmup=False)
    (line,) = [r.getMessage() for r in caplog.records if "dummy weights" in r.getMessage()]
    assert line.endswith("as float32, linear layers quantised to fp8 (per-channel e4m3)"), line
    assert engine.fp8_linear        # the server's "loaded ..." line reads this
    engine.shutdown()
