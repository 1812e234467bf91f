"""The `run-batch` progress bar: lines done of the total, output tokens/s and an ETA that makes
sense from the first written line on.

    run-batch:  40%|████      | 80/200 [00:12<00:18,  6.50req/s, 412.3 tok/s, 0 failed]

tqdm's own rate is the lines written per second so far, which cannot see a pipeline: when the
first line took a minute because every other line was in flight with it, tqdm says
`1/200 [01:00<3:21:24]`. The rate here is Little's law: lines in flight / the time a line spends
in flight, the rate a full pipeline writes at, known as soon as one line is written. The time in
flight is averaged over the latest lines written (about an eighth of those in flight), so it
follows the batch as it grows; while the slow start still fills the batch it lags, and the ETA is
early (on a 1000-line job: 10 s said at 12 s with 28 s to go; from halfway within ~2 s). Output
tokens/s count the engine's generated tokens when it can tell them (so they move before any line
is written), else the usage of the lines written.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import IO

from tqdm.auto import tqdm

# A line's time in flight is averaged over about the last in_flight // HORIZON lines written.
HORIZON = 8


class LineRate:
    """Lines per second by Little's law from (time in flight, lines in flight) of each line."""

    def __init__(self):
        self.lines = 0
        self.in_flight = 0
        self.seconds: float | None = None    # mean time in flight of the latest lines

    def add(self, seconds: float, in_flight: int) -> None:
        self.lines += 1
        self.in_flight = max(in_flight, 1)
        # the plain mean at first, then a moving one: a line's time grows with the batch (and the
        # queue) it waits in, and a longer average lags behind
        weight = 1.0 / min(self.lines, max(1, self.in_flight // HORIZON))
        self.seconds = seconds if self.seconds is None else \
            self.seconds + weight * (seconds - self.seconds)

    @property
    def per_s(self) -> float | None:
        return self.in_flight / self.seconds if self.seconds else None


class _Bar(tqdm):
    """tqdm whose rate (and so its ETA) is `line_rate`'s, not lines written / elapsed."""

    def __init__(self, *args, line_rate: LineRate, **kwargs):
        self.line_rate = line_rate      # before tqdm's __init__, which draws the bar
        super().__init__(*args, **kwargs)

    @property
    def format_dict(self):
        d = super().format_dict
        d["rate"] = self.line_rate.per_s
        return d


class BatchProgress:
    """The bar on `file` for `total` lines (None: unknown, no ETA). generated_tokens: the engine's
    count of output tokens so far, for a live tokens/s (None: count the written lines' usage)."""

    def __init__(self, total: int | None, file: IO[str], *,
                 generated_tokens: Callable[[], int] | None = None, refresh_s: float = 1.0):
        self.rate = LineRate()
        self._generated = generated_tokens
        self._tokens_at_start = generated_tokens() if generated_tokens else 0
        self._t0 = time.perf_counter()
        self._refresh_s = refresh_s
        self._stats = None
        self.bar = _Bar(total=total, desc="run-batch", unit="req", file=file, dynamic_ncols=True,
                        line_rate=self.rate)

    def line_done(self, stats, in_flight: int, seconds: float | None = None) -> None:
        """A line written or skipped; `stats` (BatchStats) counts them. seconds: how long it was
        in flight, with about `in_flight` lines; None for a line that never reached the engine
        (skipped on --resume, or answered 400 as read)."""
        self._stats = stats
        if seconds is not None:
            self.rate.add(seconds, in_flight)
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(stats.lines + stats.skipped - self.bar.n)

    def postfix(self) -> str:
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        if self._generated is not None:
            tokens = self._generated() - self._tokens_at_start
        else:
            tokens = self._stats.completion_tokens if self._stats else 0
        failed = self._stats.failed if self._stats else 0
        return f"{tokens / elapsed:.1f} tok/s, {failed} failed"

    async def tick(self) -> None:
        """Redraw every refresh_s (tokens/s and the clock move between written lines)."""
        while True:
            await asyncio.sleep(self._refresh_s)
            self.bar.set_postfix_str(self.postfix(), refresh=False)
            self.bar.refresh()

    def close(self) -> None:
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.close()
