"""Start a real `jaxserve serve` subprocess on 127.0.0.1 for the server tests (one per module)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"     # the default model's served name
# Small engine settings: the default model runs on 2 shared CPU cores.
SMALL_ENGINE = ["--max-model-len", "512", "--max-num-batched-tokens", "128",
                "--max-num-seqs", "64", "--num-gpu-blocks-override", "512"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
    """POST a JSON body -> (status, the JSON reply), error statuses included."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post(server, path, body=None, *, raw=None, headers=None):
    """POST `body` as JSON (or the bytes `raw`) to the server's `path` -> the httpx response."""
    try:                     # the openai client's HTTP library (httpx2 in openai >= 3)
        import httpx2 as httpx
    except ImportError:
        import httpx
    headers = headers or {"Content-Type": "application/json"}
    return httpx.post(server.base_url + path, content=raw if raw is not None else json.dumps(body),
                      headers=headers, timeout=120)


def assert_still_serves(client):
    """A short completion through the openai `client` still comes back."""
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason == "length"


def greedy_texts(base_url: str, prompts: list, max_tokens: int) -> list[str]:
    """/v1/completions of `prompts` (token id lists), greedy, `max_tokens` each -> their texts."""
    status, body = post_json(base_url + "/v1/completions",
                             {"prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
                              "ignore_eos": True})
    assert status == 200, body
    return [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The status code of GET url, or None when nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (TimeoutError, urllib.error.URLError, ConnectionError, OSError):
        return None


class ServerProcess:
    def __init__(self, *extra_args: str, log_path: str | Path | None = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path or f"/tmp/jaxserve-test-server-{self.port}.log")
        self.args = [sys.executable, "-m", "jaxserve.server.cli", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), *SMALL_ENGINE, *extra_args]
        self.health_seen: list[int] = []     # distinct /health statuses, in order
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 600.0) -> ServerProcess:
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            status = http_status(self.base_url + "/health")
            if status is not None and (not self.health_seen or self.health_seen[-1] != status):
                self.health_seen.append(status)
            if status == 200:
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
