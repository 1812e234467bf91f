"""`jaxserve run-batch`: offline OpenAI Batch jobs over JSONL, streamed through the engine.

    jaxserve run-batch -i in.jsonl -o out.jsonl [MODEL] [engine flags] [--resume] [--ordered]

Input lines are `{"custom_id", "method": "POST", "url", "body"}` with url `/v1/completions`,
`/v1/chat/completions` or (a pooling model) `/v1/embeddings`; bodies are validated and answered
by the server's own code, so a line gets exactly the JSON the HTTP server would have returned. Output lines are
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`.

Semantics:
- Streaming: lines are read lazily; at most `--max-concurrency` lines are read and not yet
  written at any time, which keeps memory bounded however long the file is. (Only the set of
  custom_ids seen is kept, to find repeats.) The default is 2 x max_num_seqs (the engine's batch
  and as many waiting, so the batch refills in the step a line finishes), reached by a slow
  start: max_num_seqs / 8 at first, and each line written lets in four (its replacement and
  three more), so the batch is full after two rounds. Lines sent together and as long as each
  other finish together: sent whole, a 200-line job of them wrote nothing until its end;
  staggered, its first lines land after one small round and the rest follow round by round.
- Each result is written and flushed as soon as it is known: in completion order by default, in
  input order with `--ordered` (the same bound then also caps the reorder buffer).
- `--resume` keeps an existing output file, truncates a torn last line, and skips every input
  line that file already answers (failed answers included), so a rerun after a crash completes
  the file with each custom_id exactly once.
- A bad line (not JSON, no string custom_id, method other than POST, unknown url, invalid body,
  repeated custom_id) is answered with a status 400 line and the job goes on; an unknown
  `body.model` (neither the loaded model nor --served-model-name) gets 404; an omitted
  `body.model` means the loaded model.
- A server-side failure (5xx: the engine died, an internal error) is not the line's fault: no
  line is written for it or for the requests still in flight, the job stops with exit code 3,
  and `--resume` redoes every line not written.
- Ctrl-C stops the job: the lines written so far stay, the requests in flight are dropped, and
  the summary line ends with the `--resume` command that continues it (exit code 130).
- Exit code 0 when every line of the output file is a success, 1 otherwise (2 for usage errors,
  3 when stopped early as above, 130 on Ctrl-C).
- Progress (lines, output tokens/s, ETA; `BatchProgress`) and a summary go to stderr;
  `-i -` / `-o -` are stdin/stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator

from jaxserve.server.batch import jsonl as batch_io
from jaxserve.server.batch.jsonl import DUPLICATE_CODE, JsonlWriter, ResumeState, error_body, output_line
from jaxserve.server.batch.progress import BatchProgress
from jaxserve.server.openai.lora import lora_models_at_start, parse_lora_module

logger = logging.getLogger("jaxserve")

# A route answers one validated-envelope body: returns the response JSON, or raises an error that
# carries an HTTP status (the server's OpenAIError) or a ValueError (400).
Route = Callable[[dict], Awaitable[dict]]

# The default slow start: max_num_seqs // RAMP_DIVISOR lines in flight at first, and each line
# written lets RAMP_GROWTH more in besides its replacement (the window quadruples a round).
RAMP_DIVISOR = 8
RAMP_GROWTH = 3


def in_flight_limits(max_concurrency: int | None, max_num_seqs: int) -> tuple[int, int]:
    """(first, most): lines in flight at the start, and at most. `--max-concurrency N` is N from
    the start; the default is 2 x max_num_seqs reached by a slow start from
    max_num_seqs / RAMP_DIVISOR (see the module docstring)."""
    if max_concurrency is not None:
        return max_concurrency, max_concurrency
    return max(1, max_num_seqs // RAMP_DIVISOR), 2 * max_num_seqs


@dataclasses.dataclass
class BatchStats:
    lines: int = 0              # input lines answered by this run
    ok: int = 0
    failed: int = 0
    skipped: int = 0            # already answered in the output file (--resume)
    skipped_failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    max_in_flight: int = 0      # the most lines read but not yet written, at any moment
    stopped_by: str | None = None   # a 5xx (engine dead, internal error) that stopped the job
    interrupted: bool = False       # Ctrl-C (SIGINT) stopped the job
    resume_command: str = "the same command with --resume"

    @property
    def exit_code(self) -> int:
        """0: every line answered with 2xx; 1: some lines failed (4xx); 3: the job stopped early
        on a server-side failure and `--resume` redoes the lines it did not write; 130: Ctrl-C."""
        if self.interrupted:
            return 130
        if self.stopped_by is not None:
            return 3
        return 0 if self.failed == 0 and self.skipped_failed == 0 else 1

    def summary(self) -> str:
        rate = self.lines / self.wall_s if self.wall_s else 0.0
        tok = self.completion_tokens / self.wall_s if self.wall_s else 0.0
        return (f"run-batch: {self.lines} lines ({self.ok} ok, {self.failed} failed), "
                f"{self.skipped} skipped as already done, {self.prompt_tokens} prompt + "
                f"{self.completion_tokens} completion tokens in {self.wall_s:.1f} s "
                f"({rate:.2f} req/s, {tok:.1f} output tok/s)"
                + (f"; STOPPED early by {self.stopped_by}: lines not written are not done, "
                   f"continue with: {self.resume_command}" if self.stopped_by else "")
                + ("; INTERRUPTED: lines not written are not done, continue with: "
                   f"{self.resume_command}" if self.interrupted else ""))


@dataclasses.dataclass
class _Job:
    seq: int
    custom_id: str | None
    url: str | None = None
    body: dict | None = None
    status: int = 0             # set when the line is answered before any engine work
    response: dict | None = None


def _status_of(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, error body) for an exception raised while answering a line."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and hasattr(exc, "message"):
        body = exc.to_dict() if hasattr(exc, "to_dict") else error_body(
            exc.message, getattr(exc, "type", "BadRequestError"), getattr(exc, "param", None),
            status)
        return status, body
    try:
        from pydantic import ValidationError
        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            param = ".".join(str(p) for p in err.get("loc", ())) or None
            return 400, error_body(f"{param}: {err.get('msg')}" if param else str(err.get("msg")),
                                   "BadRequestError", param, 400)
    except ImportError:
        pass
    if isinstance(exc, (ValueError, TypeError)):
        return 400, error_body(str(exc), "BadRequestError", None, 400)
    return 500, error_body(f"{type(exc).__name__}: {exc}", "InternalServerError", None, 500)


class BatchRunner:
    """Reads envelopes, answers them through `routes` with bounded concurrency, writes results.

    routes: url -> async function(body) -> response JSON. max_in_flight: the most lines read but
    not yet written; start_in_flight (default: max_in_flight): the most at first, RAMP_GROWTH
    more per line written up to max_in_flight. ordered: write in input order. resume: what the output
    already holds.
    """

    def __init__(self, routes: dict[str, Route], writer: JsonlWriter, *, max_in_flight: int,
                 start_in_flight: int | None = None, ordered: bool = False,
                 resume: ResumeState | None = None, progress: BatchProgress | None = None):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if start_in_flight is not None and not 1 <= start_in_flight <= max_in_flight:
            raise ValueError(f"start_in_flight must be in [1, max_in_flight={max_in_flight}], "
                             f"got {start_in_flight}")
        self.routes, self.writer = routes, writer
        self.max_in_flight, self.ordered = max_in_flight, ordered
        self._window = start_in_flight or max_in_flight     # grows as lines are written
        self.resume = resume or ResumeState()
        self.progress = progress
        self.stats = BatchStats(skipped_failed=self.resume.failed)
        self._seen: set[str] = set()
        self._dups: dict[str, int] = {}
        self._anonymous = 0
        self._open = 0                       # read and not yet written
        # for the progress ETA: seq -> when read, and the lines in flight after the latest read
        # (not counted at writes, which come in bursts before the next read refills)
        self._admitted_at: dict[int, float] = {}
        self._filled = 0
        self._slot_free: asyncio.Event | None = None
        self._buffer: dict[int, dict | None] = {}   # --ordered: seq -> line (None: skipped)
        self._next_seq = 0
        self._tasks: set[asyncio.Task] = set()
        self._t0 = 0.0

    # -- parsing ------------------------------------------------------------------------------
    def _parse(self, seq: int, lineno: int, text: str) -> _Job | None:
        """A job to run, a job already answered (status set), or None (skip: already done)."""
        try:
            obj = json.loads(text)
        except ValueError as e:
            return self._bad(seq, None, f"line {lineno}: invalid JSON ({e})")
        if not isinstance(obj, dict):
            return self._bad(seq, None, f"line {lineno}: expected a JSON object, got "
                                        f"{type(obj).__name__}")
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            return self._bad(seq, None, f"line {lineno}: 'custom_id' must be a non-empty string",
                             "custom_id")
        if cid in self._seen:
            k = self._dups[cid] = self._dups.get(cid, 0) + 1
            if k <= self.resume.duplicates.get(cid, 0):
                return None
            return self._bad(seq, cid, f"line {lineno}: duplicate custom_id {cid!r}",
                             "custom_id", DUPLICATE_CODE)
        self._seen.add(cid)
        if cid in self.resume.done:
            return None
        if obj.get("method", "POST") != "POST":
            return self._bad(seq, cid, f"line {lineno}: method must be 'POST', got "
                                       f"{obj.get('method')!r}", "method")
        url = obj.get("url")
        if url not in self.routes:
            return self._bad(seq, cid, f"line {lineno}: unsupported url {url!r}; expected one of "
                                       f"{', '.join(self.routes)}", "url")
        body = obj.get("body")
        if not isinstance(body, dict):
            return self._bad(seq, cid, f"line {lineno}: 'body' must be a JSON object", "body")
        return _Job(seq, cid, url, body)

    def _bad(self, seq, cid, message, param=None, code=400) -> _Job | None:
        if cid is None:
            self._anonymous += 1
            if self._anonymous <= self.resume.anonymous:
                return None       # answered by the run we resume
        return _Job(seq, cid, status=400,
                    response=error_body(message, "BadRequestError", param, code))

    def count_unanswered(self, lines: Iterable[str]) -> int:
        """Input lines that a run with this runner's `resume` state would still answer (nothing
        is run or written)."""
        return sum(self._parse(i, lineno, text) is not None
                   for i, (lineno, text) in enumerate(batch_io.non_blank(lines)))

    # -- running ------------------------------------------------------------------------------
    async def run(self, lines: Iterable[str]) -> BatchStats:
        self._t0 = time.perf_counter()
        self._slot_free = asyncio.Event()
        source = batch_io.non_blank(lines)
        seq = itertools.count()
        try:
            while True:
                while self._open >= self._window and not self.stats.stopped_by:
                    self._slot_free.clear()
                    await self._slot_free.wait()
                if self.stats.stopped_by:
                    break
                room = self._window - self._open
                # Read in a thread: a pipe may block, and the engine loop must keep running.
                chunk = await asyncio.to_thread(_take, source, room)
                if not chunk:
                    break
                for lineno, text in chunk:
                    self._admit(next(seq), lineno, text)
                self._filled = self._open
            while self._tasks and not self.stats.stopped_by:
                await asyncio.wait(set(self._tasks), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in self._tasks:
                t.cancel()
            self.stats.wall_s = time.perf_counter() - self._t0
        return self.stats

    def _admit(self, seq: int, lineno: int, text: str) -> None:
        job = self._parse(seq, lineno, text)
        if job is None:
            self.stats.skipped += 1
            if self.progress is not None:
                self.progress.line_done(self.stats, self._filled)
            self._emit(seq, None)
            return
        self._open += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, self._open)
        if job.status:
            self._emit(seq, output_line(job.custom_id, job.status, job.response))
            return
        self._admitted_at[seq] = time.perf_counter()
        task = asyncio.get_running_loop().create_task(self._answer(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, job: _Job) -> None:
        try:
            body = await self.routes[job.url](job.body)
            status = 200
        except asyncio.CancelledError:
            raise
        except Exception as e:           # noqa: BLE001 - every failure becomes a line
            status, body = _status_of(e)
            if status >= 500:
                # Not the line's fault (the engine died, or a bug): writing an error line would
                # make --resume count it as done. Stop; what is unwritten is redone on resume.
                logger.exception("request %s failed with %d; stopping the job", job.custom_id,
                                 status)
                if self.stats.stopped_by is None:
                    self.stats.stopped_by = f"{status} on {job.custom_id!r}: " \
                                            f"{body['error']['message']}"
                self._slot_free.set()
                return
        request_id = body.get("id") if status == 200 else None
        self._emit(job.seq, output_line(job.custom_id, status, body, request_id))

    def _emit(self, seq: int, line: dict | None) -> None:
        """Write a result now (completion order) or once all earlier lines are written."""
        if not self.ordered:
            if line is not None:
                self._write(seq, line)
            return
        self._buffer[seq] = line
        while self._next_seq in self._buffer:
            ready = self._buffer.pop(self._next_seq)
            self._next_seq += 1
            if ready is not None:
                self._write(self._next_seq - 1, ready)

    def _write(self, seq: int, line: dict) -> None:
        self.writer.write(line)
        self._open -= 1
        self._window = min(self._window + RAMP_GROWTH, self.max_in_flight)
        self._slot_free.set()
        st = self.stats
        st.lines += 1
        if batch_io.is_success(line):
            st.ok += 1
            usage = line["response"]["body"].get("usage") or {}
            st.prompt_tokens += usage.get("prompt_tokens") or 0
            st.completion_tokens += usage.get("completion_tokens") or 0
        else:
            st.failed += 1
        since = self._admitted_at.pop(seq, None)    # None: answered as read (a bad line)
        if self.progress is not None:
            self.progress.line_done(st, self._filled,
                                    None if since is None else time.perf_counter() - since)


def _take(source: Iterator, n: int) -> list:
    return list(itertools.islice(source, n))


ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")


# -- the engine side: routes over the server's code -------------------------------------------------
def engine_routes(serving) -> dict[str, Route]:
    """`/v1/completions` and `/v1/chat/completions` answered by the server's `OpenAIServing`:
    the same body validation, model check (404), prompt checks and response JSON as HTTP."""
    from jaxserve.server.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        OpenAIError,
        check_json_body,
        validate_request,
    )

    def route(model_cls, endpoint):
        async def answer(body: dict) -> dict:
            if body.get("stream"):
                raise OpenAIError(400, "stream is not supported in batch jobs", param="stream")
            check_json_body(body)
            return await endpoint(validate_request(model_cls, body))
        return answer

    from jaxserve.server.openai.embeddings import EmbeddingRequest, create_embedding

    return {"/v1/completions": route(CompletionRequest, serving.create_completion),
            "/v1/chat/completions": route(ChatCompletionRequest,
                                          serving.create_chat_completion),
            "/v1/embeddings": route(EmbeddingRequest,
                                    lambda request: create_embedding(serving, request, None))}


# -- CLI -----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from jaxserve.server.cli.flags import add_engine_args, add_tool_arguments
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("-i", "--input-file", required=True, help="input JSONL ('-' for stdin)")
    p.add_argument("-o", "--output-file", required=True, help="output JSONL ('-' for stdout)")
    p.add_argument("--resume", action="store_true",
                   help="keep the output file and skip the lines it already answers")
    p.add_argument("--ordered", action="store_true",
                   help="write results in input order (default: completion order)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="most lines read but not yet written, from the start (default: "
                        "2 x max_num_seqs, reached by a slow start from max_num_seqs / 8)")
    p.add_argument("--disable-progress-bar", action="store_true", help="no progress bar on stderr")
    p.add_argument("--config", default=None, help="YAML file of flag values.")
    p.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters a line's body.model may name (with --enable-lora)")
    add_engine_args(p)
    add_tool_arguments(p)


def run(ns: argparse.Namespace) -> int:
    from jaxserve.server.cli.flags import check_tool_arguments, engine_args_from
    check_tool_arguments(ns)
    if ns.resume and ns.output_file == "-":
        print("run-batch: --resume needs an output file, not stdout", file=sys.stderr)
        return 2
    if ns.max_concurrency is not None and ns.max_concurrency < 1:
        print("run-batch: --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    try:
        # Ctrl-C: asyncio.run cancels _run, which closes the output, stops the engine and says
        # how to go on; a second Ctrl-C (or one before the job starts) lands here.
        return asyncio.run(_run(ns, engine_args_from(ns)))
    except KeyboardInterrupt:
        print("run-batch: interrupted", file=sys.stderr)
        return 130


def resume_command(ns: argparse.Namespace) -> str:
    """The command line that continues this job: its own arguments plus --resume."""
    if ns.output_file == "-":
        return "nothing: the output went to stdout; rerun with -o FILE to be able to resume"
    args = list(getattr(ns, "_argv", None) or ["run-batch", "-i", ns.input_file, "-o", ns.output_file])
    return shlex.join(["jaxserve", *args, *([] if "--resume" in args else ["--resume"])])


async def _run(ns, engine_args) -> int:
    from jaxserve.engine.async_llm import AsyncLLM
    from jaxserve.server.openai.serving import OpenAIServing
    from jaxserve.server.openai.templates import load_chat_template
    chat_template = load_chat_template(ns.chat_template)

    resume = batch_io.repair_and_scan(ns.output_file) if ns.resume else ResumeState()
    if resume.truncated_bytes:
        print(f"run-batch: truncated a torn last line ({resume.truncated_bytes} bytes) of "
              f"{ns.output_file}", file=sys.stderr)
    if ns.resume and resume.lines and os.path.isfile(ns.input_file):
        with batch_io.open_input(ns.input_file) as lines:
            left = BatchRunner(dict.fromkeys(ENDPOINTS), None, max_in_flight=1,
                               resume=resume).count_unanswered(lines)
        if not left:    # say so before loading a model for nothing
            print(f"run-batch: {ns.output_file} already answers every line of {ns.input_file} "
                  f"({resume.lines} lines, {resume.failed} failed); nothing to do",
                  file=sys.stderr)
            return 1 if resume.failed else 0
    llm = AsyncLLM(engine_args)
    try:
        await llm.start()
    except asyncio.CancelledError:
        print("run-batch: interrupted while loading the model; nothing was written", file=sys.stderr)
        # the engine thread is still building the model and the interpreter would wait for it
        sys.stderr.flush()
        os._exit(130)
    serving = OpenAIServing(llm, ns.served_model_name,
                            enable_auto_tools=bool(ns.enable_auto_tool_choice),
                            tool_parser=ns.tool_call_parser,
                            reasoning_parser=ns.reasoning_parser, chat_template=chat_template)
    try:
        serving.lora = await lora_models_at_start(llm, serving.model_name, ns.lora_modules)
    except ValueError as e:
        print(f"run-batch: {e}", file=sys.stderr)
        await llm.shutdown(graceful=False)
        return 2
    first, most = in_flight_limits(ns.max_concurrency, engine_args.max_num_seqs)
    progress = None
    if not ns.disable_progress_bar:
        progress = BatchProgress(batch_io.count_lines(ns.input_file), sys.stderr,
                                 generated_tokens=lambda: llm.stats.generation_tokens_total)
    writer = JsonlWriter.open(ns.output_file, append=ns.resume)
    runner = BatchRunner(engine_routes(serving), writer, max_in_flight=most,
                         start_in_flight=first, ordered=ns.ordered, resume=resume,
                         progress=progress)
    stats = runner.stats
    stats.resume_command = resume_command(ns)
    ticking = asyncio.create_task(progress.tick()) if progress is not None else None
    try:
        with batch_io.open_input(ns.input_file) as lines:
            await runner.run(lines)
    except asyncio.CancelledError:
        # Ctrl-C (asyncio.run cancels this task): every line written so far is whole and
        # flushed; the in-flight requests were cancelled, so --resume redoes exactly those.
        stats.interrupted = True
    finally:
        writer.close()
        if ticking is not None:
            ticking.cancel()
            progress.close()
        await llm.shutdown(graceful=False)
    print(stats.summary(), file=sys.stderr)
    return stats.exit_code
