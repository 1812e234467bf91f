"""`jaxserve run-batch`: JSONL mechanics with fake routes (fast), then the real CLI on the default
model in subprocesses (SIGKILL + --resume, bad lines, 404, stdin/stdout, --ordered)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxserve.server.batch import jsonl as batch_io
from jaxserve.server.batch.jsonl import JsonlWriter
from jaxserve.server.batch.runner import BatchRunner, in_flight_limits

REPO = Path(__file__).resolve().parent.parent


def envelope(cid, url="/v1/completions", **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


class FakeEngine:
    """Routes that answer after a delay given in the body, counting concurrent requests."""

    def __init__(self):
        self.active = self.max_active = self.calls = 0

    def routes(self):
        async def answer(body):
            if body.get("bad"):
                raise ValueError("bad body")
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            try:
                await asyncio.sleep(body.get("delay", 0.001))
            finally:
                self.active -= 1
            return {"id": f"cmpl-{body['n']}", "choices": [{"text": str(body["n"])}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}
        return {"/v1/completions": answer, "/v1/chat/completions": answer}


def run_fake(lines, *, max_in_flight=4, ordered=False, out_path=None, resume=None, fake=None):
    fake = fake or FakeEngine()
    stream = io.StringIO() if out_path is None else open(out_path, "a")
    writer = JsonlWriter(stream, close=out_path is not None)
    runner = BatchRunner(fake.routes(), writer, max_in_flight=max_in_flight, ordered=ordered,
                         resume=resume)
    stats = asyncio.run(runner.run(lines))
    text = stream.getvalue() if out_path is None else None
    writer.close()
    if out_path is not None:
        text = Path(out_path).read_text()
    return stats, [json.loads(x) for x in text.splitlines()], fake


def test_output_format_and_completion_order():
    # later lines are faster, so completion order differs from input order
    lines = [envelope(f"r{i}", n=i, delay=0.02 * (5 - i)) for i in range(5)]
    stats, out, _ = run_fake(lines, max_in_flight=8)
    assert stats.ok == 5 and stats.failed == 0 and stats.exit_code == 0
    assert [o["custom_id"] for o in out] == ["r4", "r3", "r2", "r1", "r0"]
    line = out[0]
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["error"] is None
    assert line["response"]["status_code"] == 200
    assert line["response"]["request_id"] == "cmpl-4"
    assert line["response"]["body"]["choices"][0]["text"] == "4"
    assert stats.completion_tokens == 10 and stats.prompt_tokens == 5


def test_ordered_output_keeps_input_order():
    lines = [envelope(f"r{i}", n=i, delay=0.01 * ((7 * i) % 5)) for i in range(20)]
    stats, out, fake = run_fake(lines, max_in_flight=6, ordered=True)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(20)]
    assert stats.max_in_flight <= 6 and fake.max_active <= 6


def test_bad_lines_become_400_and_job_goes_on():
    lines = ["{not json", json.dumps([1, 2]), json.dumps({"method": "POST", "url": "/v1/completions",
                                                          "body": {}}),
             envelope("a", n=1), envelope("a", n=2),                       # duplicate id
             envelope("u", url="/v1/embeddings", n=3),                     # unknown url
             json.dumps({"custom_id": "m", "method": "GET", "url": "/v1/completions", "body": {}}),
             json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/completions",
                         "body": "x"}),
             envelope("v", n=4, bad=True),                                 # route says 400
             "", "   ",                                                     # blank: ignored
             envelope("ok", n=5)]
    stats, out, _ = run_fake(lines)
    by_status = {}
    for o in out:
        by_status.setdefault(o["response"]["status_code"], []).append(o)
    assert sorted(o["custom_id"] for o in by_status[200]) == ["a", "ok"]
    bad = by_status[400]
    assert len(bad) == 8 and stats.failed == 8 and stats.exit_code == 1
    for o in bad:
        err = o["response"]["body"]["error"]
        assert err["message"] and err["type"] == "BadRequestError" and o["error"] is None
    assert [o["custom_id"] for o in bad].count(None) == 3
    params = {o["custom_id"]: o["response"]["body"]["error"]["param"] for o in bad
              if o["custom_id"]}
    assert params == {"a": "custom_id", "u": "url", "m": "method", "b": "body", "v": None}


def test_reader_is_lazy_and_in_flight_is_bounded():
    produced = []
    fake = FakeEngine()
    window = 5

    def lines():        # a generator: the runner can only read it as fast as it asks
        for i in range(300):
            # never more than `window` lines read ahead of those the engine has finished
            assert i - (fake.calls - fake.active) <= window + 1
            produced.append(i)
            yield envelope(f"r{i}", n=i, delay=0.0005 * (i % 3))

    stats, out, _ = run_fake(lines(), max_in_flight=window, fake=fake)
    assert stats.ok == 300 and len(out) == 300
    assert fake.max_active <= window and stats.max_in_flight <= window
    assert len({o["custom_id"] for o in out}) == 300


def test_default_bound_writes_first_lines_before_the_last_are_read():
    """Issue 45: 2 x max_num_seqs in flight from the start sent a job no bigger than that whole,
    and, its lines as long as each other, it wrote nothing until its end. The default now gets
    there by a slow start: the first lines are written while later ones are still unread, and
    the batch is full after two rounds."""
    assert in_flight_limits(None, max_num_seqs=16) == (2, 32)
    assert in_flight_limits(None, max_num_seqs=4) == (1, 8)
    assert in_flight_limits(5, max_num_seqs=16) == (5, 5)      # --max-concurrency: from the start
    events = []

    class Recorder(io.StringIO):
        def write(self, text):
            events.append(("write", json.loads(text)["custom_id"]))
            return super().write(text)

    def lines():
        for i in range(16):
            events.append(("read", f"r{i}"))
            yield envelope(f"r{i}", n=i, delay=0.02)        # equal lengths: they finish together

    first, most = in_flight_limits(None, max_num_seqs=16)
    fake = FakeEngine()
    runner = BatchRunner(fake.routes(), JsonlWriter(Recorder(), close=False), max_in_flight=most,
                         start_in_flight=first)
    stats = asyncio.run(runner.run(lines()))
    assert stats.ok == 16 and fake.max_active <= 16
    assert events.index(("write", "r0")) < events.index(("read", "r15"))
    # lines read when each line was written: rounds of 2, then 2 + 2 x 3 = 8, then the rest
    # (the window, 2 + 10 x 3, has room for all)
    read_at_write = [sum(kind == "read" for kind, _ in events[:i])
                     for i, (kind, _) in enumerate(events) if kind == "write"]
    assert read_at_write == [2] * 2 + [10] * 8 + [16] * 6


def test_engine_death_stops_the_job_and_resume_redoes_the_rest(tmp_path):
    """A 5xx is not the line's fault: no error line is written for it or for anything still in
    flight, the job stops with exit code 3, and --resume answers every remaining line."""
    from jaxserve.server.openai.protocol import OpenAIError

    class DyingEngine(FakeEngine):
        def routes(self):
            inner = super().routes()["/v1/completions"]

            async def answer(body):
                if body["n"] >= 10:
                    raise OpenAIError(503, "The engine is dead: RuntimeError('device lost')")
                return await inner(body)
            return {"/v1/completions": answer}

    out = tmp_path / "out.jsonl"
    lines = [envelope(f"r{i}", n=i, delay=0.001 * (i % 3)) for i in range(200)]
    stats, written, _ = run_fake(lines, out_path=str(out), fake=DyingEngine(), max_in_flight=8)
    assert stats.exit_code == 3 and "503 on" in stats.stopped_by and "STOPPED" in stats.summary()
    assert all(o["response"]["status_code"] == 200 for o in written)
    assert {o["custom_id"] for o in written} <= {f"r{i}" for i in range(10)}
    state = batch_io.repair_and_scan(str(out))
    stats, final, _ = run_fake(lines, out_path=str(out), resume=state)
    assert stats.exit_code == 0 and stats.skipped == len(written)
    assert sorted(o["custom_id"] for o in final) == sorted(f"r{i}" for i in range(200))


def test_resume_repairs_torn_line_and_skips_done(tmp_path):
    out = tmp_path / "out.jsonl"
    lines = (["{bad"] + [envelope(f"r{i}", n=i) for i in range(10)] + [envelope("r3", n=99)])
    # a first run that got 4 lines out (one anonymous error, r0..r2), then died mid-line
    first = [batch_io.output_line(None, 400, batch_io.error_body("bad"))] + \
        [batch_io.output_line(f"r{i}", 200, {"id": f"x{i}"}) for i in range(3)]
    out.write_text("".join(json.dumps(x) + "\n" for x in first) + '{"id": "batch_req_1", "cus')
    state = batch_io.repair_and_scan(str(out))
    assert state.truncated_bytes > 0 and state.done == {"r0", "r1", "r2"}
    assert state.anonymous == 1 and state.failed == 1
    assert out.read_text().endswith("\n")
    stats, result, _ = run_fake(lines, out_path=str(out), resume=state)
    ids = [o["custom_id"] for o in result]
    assert ids.count(None) == 1
    assert sorted(i for i in ids if i) == sorted([f"r{i}" for i in range(10)] + ["r3"])
    assert stats.skipped == 4 and stats.exit_code == 1     # the bad line and the repeat fail
    # resuming a complete file does nothing
    state = batch_io.repair_and_scan(str(out))
    stats, again, _ = run_fake(lines, out_path=str(out), resume=state)
    assert again == result and stats.lines == 0 and stats.skipped == 12


def test_count_lines(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text("a\nb\nc")
    assert batch_io.count_lines(str(p)) == 3
    assert batch_io.count_lines("-") is None


# -- the real CLI on the default model ----------------------------------------------------------
ENGINE_FLAGS = ["--max-model-len", "256", "--max-num-seqs", "16", "--max-num-batched-tokens",
                "256", "--kv-cache-memory-bytes", "32M"]


def cli(*args, stdin=None, **kw):
    cmd = [sys.executable, "-c", "import sys; from jaxserve.server.cli.main import main; sys.exit(main())",
           "run-batch", *ENGINE_FLAGS, *args]
    # SIGINT at its default in the job: a suite started in the background (`cmd &`) ignores it, and
    # the child would inherit that, so the Ctrl-C test would test the launcher, not run-batch
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **kw)


def completion(cid, i, max_tokens=8, **extra):
    return envelope(cid, prompt=f"Item {i}: a short line about the number {i}.",
                    max_tokens=max_tokens, temperature=0, **extra)


COLOR_TOOL = {"type": "function", "function": {"name": "set_color", "parameters": {
    "type": "object", "required": ["color"], "properties": {"color": {"enum": ["red", "blue"]}}}}}


def read_out(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines()]


@pytest.mark.slow
def test_cli_lines_models_and_errors(tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [completion(f"c{i}", i) for i in range(6)] + [
        envelope("chat", url="/v1/chat/completions", max_tokens=8,
                 messages=[{"role": "user", "content": "Hi"}]),
        completion("named", 7, model="SmolLM2-135M-Instruct"),
        completion("alias", 8, model="my-alias"),
        completion("unknown", 9, model="gpt-4"),                 # 404
        envelope("badtemp", prompt="x", temperature=-1),        # SamplingParams says 400
        envelope("noprompt", max_tokens=3),                     # pydantic says 400
        envelope("json", url="/v1/chat/completions", max_tokens=40, temperature=0,
                 messages=[{"role": "user", "content": "A color as JSON"}],
                 response_format={"type": "json_schema", "json_schema": {
                     "name": "c", "schema": {"type": "object", "required": ["color"],
                                             "properties": {"color": {"enum": ["red", "blue"]}}}}}),
        envelope("badschema", prompt="x", guided_json={"type": "strnig"}),  # grammar says 400
        envelope("tool", url="/v1/chat/completions", max_tokens=40, temperature=0,
                 messages=[{"role": "user", "content": "Pick a color"}], tools=[COLOR_TOOL],
                 tool_choice={"type": "function", "function": {"name": "set_color"}}),
        envelope("auto", url="/v1/chat/completions", max_tokens=8, temperature=0,
                 messages=[{"role": "user", "content": "Hi"}], tools=[COLOR_TOOL]),
        "this is not json",
        completion("c0", 0)]                                     # duplicate
    inp.write_text("\n".join(lines) + "\n")
    p = cli("-i", str(inp), "-o", str(out), "--served-model-name", "SmolLM2-135M-Instruct",
            "my-alias", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    _, err = p.communicate(timeout=600)
    assert p.returncode == 1, err.decode()[-3000:]
    written = read_out(out)
    res = {o["custom_id"]: o for o in written if o["custom_id"] and o["custom_id"] != "c0"}
    status = {k: v["response"]["status_code"] for k, v in res.items()}
    assert status == {**{f"c{i}": 200 for i in range(1, 6)}, "chat": 200, "named": 200,
                      "alias": 200, "unknown": 404, "badtemp": 400, "noprompt": 400, "json": 200,
                      "badschema": 400, "tool": 200, "auto": 200}
    # the first c0 is answered, the repeat is a 400 naming the duplicate id
    c0 = [o for o in written if o["custom_id"] == "c0"]
    assert sorted(o["response"]["status_code"] for o in c0) == [200, 400]
    dup = next(o for o in c0 if o["response"]["status_code"] == 400)
    assert "duplicate custom_id 'c0'" in dup["response"]["body"]["error"]["message"]
    res["c1"] = next(o for o in written if o["custom_id"] == "c1")
    assert len(read_out(out)) == len(lines)
    assert res["chat"]["response"]["body"]["object"] == "chat.completion"
    assert res["alias"]["response"]["body"]["model"] == "my-alias"
    assert res["c1"]["response"]["body"]["usage"]["completion_tokens"] > 0
    assert res["unknown"]["response"]["body"]["error"]["type"] == "NotFoundError"
    text = err.decode()
    assert json.loads(res["json"]["response"]["body"]["choices"][0]["message"]["content"])[
        "color"] in ("red", "blue")
    assert "strnig" in res["badschema"]["response"]["body"]["error"]["message"]
    (call,) = res["tool"]["response"]["body"]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "set_color"
    assert json.loads(call["function"]["arguments"])["color"] in ("red", "blue")
    assert "run-batch: 18 lines (12 ok, 6 failed)" in text and "tok/s" in text


def _job_with_four_lines_written(tmp_path, n: int = 48):
    """Start a run-batch job of n long completions; return (process, input, output) once it has
    written 4 result lines (or finished or timed out: the caller asserts it is still running)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(completion(f"r{i}", i, max_tokens=24, ignore_eos=True)
                             for i in range(n)) + "\n")
    p = cli("-i", str(inp), "-o", str(out), "--max-concurrency", "8", "--max-num-seqs", "4")
    deadline = time.time() + 500
    while time.time() < deadline and p.poll() is None:
        if out.exists() and len(out.read_text().splitlines()) >= 4:
            break
        time.sleep(0.2)
    return p, inp, out


@pytest.mark.slow
def test_cli_sigkill_then_resume(tmp_path):
    n = 48
    p, inp, out = _job_with_four_lines_written(tmp_path, n)
    assert p.poll() is None, "the job finished before it could be killed"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    written = read_out(out)
    assert 4 <= len(written) < n
    with open(out, "a") as f:       # what a kill in the middle of a write leaves behind
        f.write('{"id": "batch_req_torn", "custom_id": "r4')
    p = cli("-i", str(inp), "-o", str(out), "--resume")
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err.decode()[-3000:]
    assert "truncated a torn last line" in err.decode()
    final = read_out(out)
    assert final[:len(written)] == written
    assert sorted(o["custom_id"] for o in final) == sorted(f"r{i}" for i in range(n))
    assert all(o["response"]["status_code"] == 200 and o["error"] is None for o in final)
    # resuming a finished job says so and loads no model
    before = out.read_bytes()
    p = cli("-i", str(inp), "-o", str(out), "--resume")
    _, err = p.communicate(timeout=120)
    assert p.returncode == 0, err.decode()[-3000:]
    assert f"already answers every line of {inp} ({n} lines, 0 failed); nothing to do" \
        in err.decode()
    assert "loading" not in err.decode() and out.read_bytes() == before


@pytest.mark.slow
def test_cli_ctrl_c_exits_cleanly_and_its_resume_command_finishes_the_job(tmp_path):
    n = 48
    p, inp, out = _job_with_four_lines_written(tmp_path, n)
    assert p.poll() is None, "the job finished before it could be interrupted"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    err = err.decode()
    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    (summary,) = [line for line in err.splitlines() if "INTERRUPTED" in line]
    assert summary.startswith("run-batch: ") and "ok, 0 failed" in summary
    written = read_out(out)                 # every line whole, each a success
    assert 4 <= len(written) < n and all(o["response"]["status_code"] == 200 for o in written)
    assert f"lines ({len(written)} ok" in summary
    command = shlex.split(summary.split("continue with: ", 1)[1])
    assert command[:2] == ["jaxserve", "run-batch"] and command[-1] == "--resume"
    p = subprocess.Popen([sys.executable, "-c", "import sys; from jaxserve.server.cli.main import main; "
                          "sys.exit(main())", *command[1:]], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=REPO)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err.decode()[-3000:]
    final = read_out(out)
    assert final[:len(written)] == written
    assert sorted(o["custom_id"] for o in final) == sorted(f"r{i}" for i in range(n))


@pytest.mark.slow
def test_cli_default_writes_first_lines_while_the_rest_run(tmp_path):
    """Issue 45 on the engine: 16 lines as long as each other and max_num_seqs 16. The old
    default (2 x max_num_seqs) sent all 16 at once and wrote them in one burst at the end; the
    slow start writes the first 2 after one small round and the rest follow in rounds."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(completion(f"r{i}", i, max_tokens=16, ignore_eos=True)
                             for i in range(16)) + "\n")
    p = cli("-i", str(inp), "-o", str(out))
    seen = []                           # the file's line count, each time it changed
    while p.poll() is None:
        k = len(out.read_text().splitlines()) if out.exists() else 0
        if k and (not seen or seen[-1] != k):
            seen.append(k)
        time.sleep(0.01)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()[-3000:]
    assert len(read_out(out)) == 16
    assert seen[0] <= 2 and len(seen) >= 3, seen
    bar = [f for f in err.decode().split("\r") if "/16 [" in f]
    assert any(re.search(r"\d+/16 \[\d\d:\d\d<\d\d:\d\d, .*req/s, [\d.]+ tok/s, 0 failed", f)
               for f in bar), bar


@pytest.mark.slow
def test_cli_stdin_stdout_ordered(tmp_path):
    # long and short requests alternate, so completion order would differ from input order
    lines = [completion(f"o{i}", i, max_tokens=24 if i % 2 == 0 else 2, ignore_eos=True)
             for i in range(12)]
    p = cli("-i", "-", "-o", "-", "--ordered", "--max-num-seqs", "4", stdin=subprocess.PIPE)
    stdout, err = p.communicate(("\n".join(lines) + "\n").encode(), timeout=600)
    assert p.returncode == 0, err.decode()[-3000:]
    out = [json.loads(x) for x in stdout.decode().splitlines()]
    assert [o["custom_id"] for o in out] == [f"o{i}" for i in range(12)]
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert [o["response"]["body"]["usage"]["completion_tokens"] for o in out] == \
        [24 if i % 2 == 0 else 2 for i in range(12)]
