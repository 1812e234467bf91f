"""The 60-second soak (benchmarks/soak.py) against a real server: misbehaving clients
(disconnects, cancellations, slow readers) get no 5xx, and once idle no request or KV block is
still held."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

pytestmark = pytest.mark.slow


def test_sixty_second_soak_has_no_errors_and_leaks_nothing(capsys, tmp_path):
    import soak
    code = soak.main(["--clients", "16", "--duration", "60", "--log",
                      str(tmp_path / "server.log")])
    out = capsys.readouterr().out
    assert code == 0, out + (tmp_path / "server.log").read_text()[-3000:]
    row = out.strip().splitlines()[-1] if "error:" not in out else out
    served, disconnects, cancels, errors = (int(x) for x in row.split("|")[1:5])
    assert served > 50 and disconnects > 0 and cancels > 0 and errors == 0
