"""`LLM()` is not silent in a plain script: jaxserve's INFO lines reach stderr unless the program
configured logging itself or set JAXSERVE_CONFIGURE_LOGGING=0."""

from __future__ import annotations

import os
import subprocess
import sys

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
