"""The package as `pip install .` builds it: the wheel holds every module of the tree.

.ci/wheel_check also installs that wheel into a fresh venv and generates from it (CI only: ~30 s);
this test runs its file-list half, which a hand-written package list once failed
(jaxserve.spec_decode was not installed, so `import jaxserve.engine.llm_engine` failed).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="lists the tree with git")
def test_a_wheel_built_from_the_tree_holds_every_module_and_no_bare_server():
    r = subprocess.run([sys.executable, str(REPO / ".ci" / "wheel_check"), "--contents-only"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "holds every module of jaxserve/ and server/" in r.stdout
