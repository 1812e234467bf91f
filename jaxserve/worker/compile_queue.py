"""Compiling programs in one background thread, in order, while the engine already serves.

`BackgroundCompiler(compile_fn, keys)` compiles `compile_fn(key)` for each key in turn on its own
thread. `get(key)` returns the program: at once when it is built; otherwise it moves the key to
the front of the queue (or waits for the compile under way) and blocks until it is built. So a
program is compiled exactly once, always on the compiler thread, never on the caller's: a step
that needs a program still queued waits for that one compile instead of compiling it twice.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable

logger = logging.getLogger(__name__)

NICE = 10       # the compiler thread's nice value (the step's thread keeps the process's)


class BackgroundCompiler:
    def __init__(self, compile_fn: Callable[[Hashable], object], keys: Iterable[Hashable], *,
                 name: str = "jaxserve-compile", on_done: Callable[[float], None] | None = None):
        """Starts the thread at once. on_done(seconds) is called on it when the queue is empty."""
        self._compile = compile_fn
        self._cond = threading.Condition()
        self._queue: list[Hashable] = []
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        for key in keys:
            if key not in self._futures:
                self._queue.append(key)
                self._futures[key] = concurrent.futures.Future()
        self._closed = False
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:    # serving steps come first for the CPU (Linux: a thread's own nice value)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key = self._queue.pop(0)
                future = self._futures[key]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._compile(key))
            except BaseException as e:      # the step that needs it raises it
                logger.error("background compile of %s failed: %s", key, e)
                future.set_exception(e)
            with self._cond:
                idle = not self._queue and not self._closed      # done, not stopped
            if idle and self._on_done is not None:
                self._on_done(time.perf_counter() - t0)

    def get(self, key: Hashable, timeout: float | None = None):
        """The program for `key` (queued first if unknown), waiting for its compile."""
        with self._cond:
            future = self._futures.get(key)
            if future is None:
                future = self._futures[key] = concurrent.futures.Future()
                self._queue.insert(0, key)
            elif key in self._queue:        # not started: it goes next
                self._queue.remove(key)
                self._queue.insert(0, key)
            self._cond.notify()
        if not future.done():
            logger.info("waiting for the background compile of %s", key)
        return future.result(timeout)

    def ready(self, key: Hashable) -> bool:
        future = self._futures.get(key)
        return future is not None and future.done() and future.exception() is None

    @property
    def queued(self) -> list[Hashable]:
        """Keys not started yet, in the order they will be compiled."""
        with self._cond:
            return list(self._queue)

    @property
    def pending(self) -> int:
        """Programs queued or compiling."""
        return sum(not f.done() for f in list(self._futures.values()))

    def wait(self, timeout: float | None = None) -> None:
        """Block until every queued program is built (a failure is raised by `get`, not here)."""
        concurrent.futures.wait(list(self._futures.values()), timeout)

    def close(self, timeout: float | None = 0.0) -> None:
        """Stop after the compile under way (waiting up to `timeout` seconds for it, None: for
        as long as it takes; a process that exits mid-compile can crash in XLA's teardown);
        queued programs are cancelled."""
        with self._cond:
            self._closed = True
            for key in self._queue:
                self._futures[key].cancel()
            self._queue.clear()
            self._cond.notify()
        if timeout != 0.0 and self._thread is not threading.current_thread():
            self._thread.join(timeout)
