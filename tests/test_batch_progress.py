"""`run-batch`'s progress bar (server/batch/progress.py): output tokens/s and an ETA by Little's
law, sane from the first written line on."""

from __future__ import annotations

import asyncio
import io
import json
import re

import pytest

from jaxserve.server.batch.jsonl import JsonlWriter
from jaxserve.server.batch.progress import BatchProgress, LineRate
from jaxserve.server.batch.runner import BatchRunner, BatchStats, in_flight_limits


def frames(buf: io.StringIO) -> list[str]:
    """The bar as drawn each time (tqdm redraws over the line with a carriage return)."""
    return [f.strip() for f in buf.getvalue().split("\r") if f.strip()]


def test_eta_after_the_first_line_of_a_full_pipeline_is_one_latency():
    # issue 45: 200 lines in flight, the first written after 60 s. tqdm's own rate (1 line per
    # minute) said `1/200 [01:00<3:21:24]`; 200 in flight for 60 s each is 3.3 lines/s.
    buf = io.StringIO()
    progress = BatchProgress(200, buf)
    progress.line_done(BatchStats(lines=1, ok=1), in_flight=200, seconds=60.0)
    progress.close()
    last = frames(buf)[-1]
    assert "1/200" in last and "<00:59," in last and "3.33req/s" in last, last


def test_line_rate_follows_the_latest_batch():
    rate = LineRate()
    assert rate.per_s is None
    for _ in range(4):                  # a first round of 4 lines, 2 s each
        rate.add(2.0, in_flight=4)
    assert rate.per_s == pytest.approx(2.0)
    for _ in range(48):                 # the batch grew to 16 and a line now takes 4 s
        rate.add(4.0, in_flight=16)
    assert rate.per_s == pytest.approx(16 / 4.0, rel=0.05)     # 3 batches later


def test_bar_shows_output_tokens_per_second_before_any_line_is_written():
    generated = [0]

    def tokens():
        generated[0] += 50              # the engine keeps generating
        return generated[0]

    buf = io.StringIO()
    progress = BatchProgress(10, buf, generated_tokens=tokens, refresh_s=0.01)

    async def a_while():
        ticking = asyncio.create_task(progress.tick())
        await asyncio.sleep(0.1)
        ticking.cancel()

    asyncio.run(a_while())
    last = frames(buf)[-1]
    assert "0/10" in last, last
    (speed,) = re.findall(r"([\d.]+) tok/s, 0 failed", last)
    assert float(speed) > 0


def test_bar_of_a_job_counts_lines_tokens_and_failures():
    async def answer(body):
        if body.get("bad"):
            raise ValueError("bad body")
        await asyncio.sleep(0.01)
        return {"id": "x", "usage": {"prompt_tokens": 1, "completion_tokens": 5}}

    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"bad": i == 3}}) for i in range(24)]
    buf = io.StringIO()
    progress = BatchProgress(len(lines), buf)
    first, most = in_flight_limits(None, max_num_seqs=8)
    runner = BatchRunner({"/v1/completions": answer}, JsonlWriter(io.StringIO(), close=False),
                         max_in_flight=most, start_in_flight=first, progress=progress)
    stats = asyncio.run(runner.run(lines))
    progress.close()
    assert stats.ok == 23 and stats.failed == 1
    last = frames(buf)[-1]
    assert "24/24" in last and "req/s" in last and "<00:00" in last, last
    (speed,) = re.findall(r"([\d.]+) tok/s, 1 failed", last)
    assert float(speed) > 0
