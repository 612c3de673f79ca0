"""The ``stagewire`` command line.

::

    stagewire run CONFIG [--input JSON | --input-file FILE.jsonl] [--requests N] [--concurrency C]
                  [--external-workers] [--bind tcp://HOST:PORT] [--keys DIR]
    stagewire master CONFIG [--bind tcp://HOST:PORT] [--keys DIR]
    stagewire submit --master tcp://HOST:PORT --input JSON [--timeout S] [--keys DIR]
                     [--device DEVICE]
    stagewire validate CONFIG
    stagewire worker --master tcp://HOST:PORT --stage NAME [--replica K] [--headless]
                     [--keys DIR]
    stagewire keys DIR [--force]

Errors print one line with no traceback unless ``--debug`` is given. Exit codes:
0 success, 1 some requests failed, 2 bad configuration or input, 3 the pipeline failed to
start (``submit``: no master answered), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import itertools
import math
import os
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TextIO

import msgspec
import structlog
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from pipeline import _collector
from pipeline.__main__ import worker_argv
from pipeline._api import Pipeline, SinkOutput
from pipeline._arguments import OneLineParser
from pipeline._codec import resolve_device
from pipeline._errors import (
    ConfigError,
    MasterUnavailable,
    PayloadError,
    PipelineError,
    StageError,
)
from pipeline._exit_codes import EXIT_CONFIG
from pipeline._host import is_wildcard, split_endpoint, tcp_endpoint
from pipeline._logging import configure_logging
from pipeline._report import print_tables, render_tables
from pipeline._security import (
    KEYS_ENV,
    CurveKeys,
    make_keys,
    resolve_keys,
)
from pipeline._serve import ClientServer

__all__ = (
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_START",
    "EXIT_TERMINATED",
    "main",
)

log = structlog.get_logger("stagewire.cli")

EXIT_FAILED = 1
EXIT_START = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143

#: The most requests (or requests in flight) ``run`` takes: more than any batch needs, and
#: within what ``itertools.islice`` accepts.
MAX_COUNT = 2**31
#: The most characters ``run --input-file`` reads: its inputs are all held in memory.
MAX_INPUT_CHARS = 512 * 2**20
#: How often ``run`` writes a progress line where no bar shows, in seconds.
PROGRESS_EVERY_S = 10.0


def _json_default(obj: Any) -> Any:
    """Summarise what JSON cannot hold (tensors, arrays, bytes) instead of failing."""
    shape = getattr(obj, "shape", None)
    if shape is not None:
        return {"dtype": str(getattr(obj, "dtype", "?")), "shape": list(shape)}
    if isinstance(obj, bytes | bytearray | memoryview):
        return {"bytes": len(obj)}
    # Anything else (a tuple as a dict's key, an object of the stage's own): shown as
    # Python shows it, rather than a run that fails after its requests succeeded.
    return repr(obj)


#: An output as JSON bytes, tensors and arrays summarised.
to_json = msgspec.json.Encoder(enc_hook=_json_default).encode


class _Fail(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def _field_names(tp: Any) -> set[str] | None:
    """The names a JSON object of ``tp`` may use, if ``tp`` is a Struct that does not take
    unknown fields itself; else None."""
    if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
        return None
    config = tp.__struct_config__
    if getattr(config, "forbid_unknown_fields", False):
        return None  # msgspec refuses them already, naming them
    # A tagged Struct's tag field ("type" by default) is part of its own encoding.
    tag_field = getattr(config, "tag_field", None)
    return set(tp.__struct_encode_fields__) | ({tag_field} if tag_field else set())


#: What a JSON input nested deeper than the decoder goes is told.
_TOO_DEEP = "JSON nested too deeply to decode (give a flatter input)"


def _json_input(where: str, text: str) -> bytes:
    """``text`` (``--input``, or a line of ``--input-file``) as the UTF-8 its JSON is.

    Raises:
        _Fail: ``text`` holds bytes that are not UTF-8 (an argument's own undecodable
            bytes, which Python keeps as lone surrogates), exit code 2.
    """
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise _Fail(f"{where}: not UTF-8 text (character {exc.start + 1})", EXIT_CONFIG) from None


def _refuse_unknown_fields(where: str, given: Any, name: str, known: set[str] | None) -> None:
    """Refuse a JSON object (``given``, decoded as it is) naming a field its type lacks: a
    misspelt optional field would be dropped without a word, its default used.

    Raises:
        _Fail: the object names an unknown field (exit code 2).
    """
    if known is None:
        return
    unknown = sorted(set(given) - known) if isinstance(given, dict) else []
    if unknown:
        raise _Fail(
            f"{where}: {name} has no field {unknown[0]!r} (its fields: {', '.join(sorted(known))})",
            EXIT_CONFIG,
        )


#: The integers a payload carries: msgpack's, those of a signed or unsigned 64-bit word.
_INT_RANGE = range(-(1 << 63), 1 << 64)


def _refuse_wide_ints(where: str, given: Any) -> None:
    """Refuse JSON (``given``, decoded as it is) holding an integer no payload can carry:
    the input would be read, the workers started, and its request fail only as it is sent,
    without saying which number.

    Raises:
        _Fail: an integer is past 64 bits, named by its place (exit code 2).
    """
    todo: list[tuple[str, Any]] = [("", given)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            todo.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
        elif isinstance(value, int) and value not in _INT_RANGE:
            raise _Fail(
                f"{where}: {path or 'the input'} is {value}, which does not fit in 64 bits "
                "(payloads carry integers from -2**63 to 2**64 - 1): give it as a string, "
                "or as a float (1e23)",
                EXIT_CONFIG,
            )


def _read_inputs(pipe: Pipeline, args: argparse.Namespace) -> list[Any]:
    sources = pipe.plan.sources
    if len(sources) != 1:
        raise _Fail(f"'run' supports one source stage; this pipeline has {sources}", EXIT_CONFIG)
    tp = next(iter(pipe.plan.stages[sources[0]].inputs.values())).payload_type
    if args.input is not None:
        lines = [("--input", args.input)]
    elif args.input_file is not None:
        try:
            # utf-8-sig: a byte-order mark (as some editors save) is not part of line 1.
            # Read up to a bound: a device (/dev/zero) named by mistake never ends.
            with open(args.input_file, encoding="utf-8-sig") as f:
                text = f.read(MAX_INPUT_CHARS + 1)
            if len(text) > MAX_INPUT_CHARS:
                raise _Fail(
                    f"{args.input_file}: more than {MAX_INPUT_CHARS:,} characters: not a "
                    "file of requests (every input is held in memory: split it)",
                    EXIT_CONFIG,
                )
        except OSError as exc:
            raise _Fail(f"cannot read {args.input_file}: {exc.strerror}", EXIT_CONFIG) from exc
        except UnicodeDecodeError as exc:
            raise _Fail(
                f"{args.input_file}: not UTF-8 text (byte {exc.start}): give JSON lines",
                EXIT_CONFIG,
            ) from exc
        # Lines end at "\n" only (and a "\r" before it): str.splitlines would also split at
        # U+2028, U+2029 and U+0085, which JSON allows raw inside a string.
        lines = [
            (f"{args.input_file}:{n}", line.removesuffix("\r"))
            for n, line in enumerate(text.split("\n"), 1)
            if line.strip()
        ]
    else:
        raise _Fail("give --input JSON or --input-file FILE.jsonl", EXIT_CONFIG)
    values = []
    name = getattr(tp, "__name__", str(tp))
    known = _field_names(tp)
    for where, line in lines:
        data = _json_input(where, line)
        try:
            values.append(msgspec.json.decode(data, type=tp))
            given = msgspec.json.decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise _Fail(f"{where}: not a valid {name}: {exc}", EXIT_CONFIG) from exc
        except RecursionError:
            raise _Fail(f"{where}: {_TOO_DEEP}", EXIT_CONFIG) from None
        _refuse_unknown_fields(where, given, name, known)
        _refuse_wide_ints(where, given)
    if not values:
        raise _Fail(f"{args.input_file}: no inputs", EXIT_CONFIG)
    return values


def _load(args: argparse.Namespace) -> Pipeline:
    """The pipeline of ``args.config``, its master bound where ``--bind`` says, with the
    key pair ``--keys`` names.

    Raises:
        _Fail: the file, the bind address or the keys are invalid (exit code 2).
    """
    try:
        pipe = Pipeline.from_yaml(args.config)
    except ConfigError as exc:
        raise _Fail(str(exc), EXIT_CONFIG) from exc
    given = {k: v for k, v in (("bind", args.bind), ("keys", args.keys)) if v}
    if given:
        try:
            master = type(pipe.spec.master).model_validate(
                {**pipe.spec.master.model_dump(), **given}
            )
        except ValidationError as exc:
            error = exc.errors()[0]
            flag = f"--{error['loc'][0]}" if error["loc"] else "--bind"
            raise _Fail(f"{flag}: {error['msg']}", EXIT_CONFIG) from None
        pipe = Pipeline(pipe.spec.model_copy(update={"master": master}))
    _keys_or_fail(pipe.spec.master.keys)
    return pipe


def _keys_or_fail(directory: str | None) -> CurveKeys | None:
    """The key pair ``directory`` (or ``STAGEWIRE_KEYS``) names, if any.

    Raises:
        _Fail: it names no valid pair (exit code 2).
    """
    try:
        return resolve_keys(directory)
    except ConfigError as exc:
        raise _Fail(str(exc), EXIT_CONFIG) from None


def _named(endpoint: str) -> str:
    """``endpoint`` as peers reach it: a master bound to every interface is reached at any
    address of this host, shown by the host's name."""
    parts = split_endpoint(endpoint)
    if parts is None or not is_wildcard(parts[0]):
        return endpoint
    return tcp_endpoint(socket.gethostname(), parts[1])


async def _start(pipe: Pipeline, args: argparse.Namespace, console: Console) -> None:
    """Start the master and its workers: launched here, or (``--external-workers``) started
    by the user with the commands this prints, while a status line names those missing.

    Raises:
        _Fail: the pipeline did not start (exit code 3).
    """
    workers = sum(s.replicas for s in pipe.spec.stages.values())
    # What a stage prints goes to stderr with the logs: stdout holds the outputs alone, so
    # that `run ... > outputs.jsonl` is JSON lines.
    with contextlib.suppress(OSError, ValueError):  # (a stderr with no descriptor)
        pipe._worker_stdout = sys.stderr.fileno()
    if not args.external_workers:
        with console.status(f"starting {escape(pipe.spec.name)}: {workers} workers"):
            try:
                await pipe.start()
            except PipelineError as exc:
                raise _Fail(str(exc), EXIT_START) from exc
        return

    listening: list[str] = []
    keys = _keys_or_fail(pipe.spec.master.keys)
    with_keys = f" --keys {keys.directory}" if keys is not None else ""

    def announce(endpoint: str) -> None:
        listening.append(endpoint)
        # Plain lines, unwrapped, so they can be copied (or read by a script).
        lines = [f"master listening on {endpoint}; start each worker (any host, any order):"]
        if _named(endpoint) != endpoint:
            endpoint = _named(endpoint)
            lines[0] += " (shown by this host's name; any of its addresses serves)"
        for stage, sspec in pipe.spec.stages.items():
            for k in range(sspec.replicas):
                lines.append(
                    f"  stagewire worker --master {endpoint} --stage {stage} --replica {k}"
                    + with_keys
                )
        _say(console, "\n".join(lines))

    timeout = pipe.spec.defaults.startup_timeout
    with console.status(f"waiting for {workers} workers (up to {timeout:g}s)") as status:
        starting = asyncio.ensure_future(pipe.start(launch=False, on_listening=announce))
        # Where no status line shows (stderr is not a terminal), a line now and then.
        every = getattr(args, "progress_every", PROGRESS_EVERY_S)
        next_line = time.monotonic() + every
        try:
            while not (await asyncio.wait([starting], timeout=0.5))[0]:
                try:
                    missing = pipe.waiting_for() if listening else []
                except RuntimeError:
                    # The start failed and is closing the pipeline: its error comes next.
                    # (It escaped as a traceback, exit 1, when a look fell in that close.)
                    missing = []
                if missing:
                    waiting = f"waiting for {len(missing)} of {workers} workers: "
                    status.update(waiting + escape(", ".join(missing)))
                    if not console.is_terminal and time.monotonic() >= next_line:
                        _say(console, waiting + ", ".join(missing))
                        next_line = time.monotonic() + every
            await starting
        except PipelineError as exc:
            raise _Fail(str(exc), EXIT_START) from exc
        finally:
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)


async def _run(args: argparse.Namespace, console: Console) -> int:
    pipe = _load(args)
    inputs = _read_inputs(pipe, args)
    total = args.requests or len(inputs)
    t0 = time.perf_counter()
    await _start(pipe, args, console)
    _collector.settle()
    started = time.perf_counter() - t0
    log.info("run_started", pipeline=pipe.spec.name, requests=total, startup_s=round(started, 3))
    failures: list[tuple[int, str]] = []
    #: With --debug, the stage tracebacks of the first failures.
    tracebacks: list[str] = []
    # Outputs in memory: every one with --print-outputs; else the three of the lowest
    # request numbers, as a heap of (-number, number, output) (the rest are counted).
    outputs: list[tuple[int, int, Any]] = []
    completed = 0

    def keep(i: int, out: Any) -> None:
        nonlocal completed
        completed += 1
        if args.print_outputs:
            outputs.append((-i, i, out))
        elif len(outputs) < 3:
            heapq.heappush(outputs, (-i, i, out))
        elif i < outputs[0][1]:
            heapq.heapreplace(outputs, (-i, i, out))

    try:
        if args.show_stream is not None:
            await _show_stream(pipe, inputs[0], args.show_stream, console)
        queue = iter(enumerate(itertools.islice(itertools.cycle(inputs), total)))
        progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[failed]} failed"),
            console=console,
            # Off a terminal no bar shows (progress lines do, see _progress_lines): a
            # transient one left a blank line at the top of the output.
            disable=not console.is_terminal,
        )
        with progress:
            task = progress.add_task("requests", total=total, failed=0)

            async def client() -> None:
                for i, value in queue:
                    try:
                        keep(i, await pipe.submit(value))
                    except PipelineError as exc:
                        failures.append((i, f"request {i}: {exc}"))
                        if args.debug and isinstance(exc, StageError) and len(tracebacks) < 3:
                            tracebacks.append(exc.traceback)
                        progress.update(task, failed=len(failures))
                    progress.advance(task)

            t1 = time.perf_counter()
            # No more clients than requests (the others would find the queue empty), nor
            # than the pipeline admits at once (the others would only wait for a slot, each
            # a coroutine in memory: --concurrency 2**31 ran the machine out of it).
            admits = pipe.spec.defaults.max_inflight
            clients = max(1, min(args.concurrency, total, admits))
            if admits < min(args.concurrency, total):
                console.print(
                    f"--concurrency {args.concurrency}: the pipeline admits {admits} requests "
                    "at once (defaults.max_inflight), so that many are in flight"
                )
            every, report = args.progress_every, lambda: _progress_line(progress, task, total)
            async with _progress_lines(console, every, report):
                await asyncio.gather(*(client() for _ in range(clients)))
            elapsed = time.perf_counter() - t1
        stats = await pipe.statistics()
    finally:
        await pipe.aclose()
    shown = sorted((i, out) for _, i, out in outputs)
    stdout = _Stdout(console)  # a reader that stopped (``| head``): the figures still follow
    for i, out in shown:
        stdout.write(f"{i}: {to_json(out).decode()}\n", flush=False)
    stdout.write("")
    if len(shown) < completed:
        console.print(f"({completed - len(shown)} more outputs; --print-outputs shows all)")
    spec = pipe.spec
    print_tables(
        console, render_tables(stats, [e.name for e in spec.edges], spec.topological_order())
    )
    if stats.get("unanswered"):
        # Their figures are not in the tables: say so, rather than show partial sums.
        silent = ", ".join(stats["unanswered"])
        console.print(f"[yellow]no figures from {escape(silent)}[/yellow] (not ready, or silent)")
    # The request streamed first is in the tables' counts, not in the batch's.
    streamed = (
        " (and the one streamed first, counted in the tables)"
        if args.show_stream is not None
        else ""
    )
    console.print(
        f"{total - len(failures)}/{total} requests ok{streamed} in {elapsed:.2f}s "
        f"({total / elapsed:.0f} req/s at concurrency {clients}); "
        f"workers started in {started:.2f}s"
    )
    for _, line in sorted(failures)[:5]:
        console.print(f"[red]failed[/red] {escape(_one_line(line))}", soft_wrap=True)
    for text in tracebacks:
        console.print(f"stage traceback:\n{text}", highlight=False, markup=False)
    # Outputs asked for and not written (a full disk) are a failure too, not a quiet 0.
    return EXIT_FAILED if failures or stdout.lost else 0


def _progress_line(progress: Progress, task: TaskID, total: int) -> str:
    state = progress.tasks[task]
    rate = state.completed / state.elapsed if state.elapsed else 0.0
    return (
        f"progress: {state.completed:g}/{total} requests, {state.fields['failed']} failed, "
        f"{rate:.1f} req/s, {state.elapsed or 0:.0f}s elapsed"
    )


@contextlib.asynccontextmanager
async def _progress_lines(
    console: Console, every: float, line: Callable[[], str]
) -> AsyncIterator[None]:
    """Where no bar shows (stderr is not a terminal), write ``line()`` every ``every``
    seconds while the body runs, so that a log shows a long run moving."""
    if console.is_terminal:
        yield
        return

    async def tick() -> None:
        while True:
            await asyncio.sleep(every)
            _say(console, line())

    ticker = asyncio.ensure_future(tick())
    try:
        yield
    finally:
        ticker.cancel()
        await asyncio.gather(ticker, return_exceptions=True)


class _Stdout:
    """Standard output for a command's results. Once its reader has gone (``| head``) the
    rest is dropped quietly; once it cannot be written otherwise (a full disk, closed) that
    is said once on the console, and, but for a stdout closed from the start, the command's
    exit status says so (``lost``); either way the command goes on, its figures on
    stderr."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self.dead = False
        #: Outputs were lost: stdout failed otherwise than by its reader going away.
        self.lost = False

    def write(self, text: str, *, flush: bool = True) -> None:
        if self.dead:
            return
        try:
            if sys.stdout is None:
                raise OSError("standard output is closed")
            sys.stdout.write(text)
            if flush:
                sys.stdout.flush()
        except BrokenPipeError:
            self.dead = True
            _quiet_stdout()
        except OSError as exc:
            # Closed by whoever started the command (``>&-``) is no loss: nobody reads.
            self.dead = True
            self.lost = sys.stdout is not None
            self._console.print(f"[yellow]cannot write the outputs:[/yellow] {escape(str(exc))}")


def _by_sink(sink: str, value: Any) -> Any:
    """A chunk as printed: the value, or ``{sink: value}`` from a pipeline of several sinks."""
    return {sink: value} if sink else value


async def _show_stream(pipe: Pipeline, value: Any, field: str, console: Console) -> None:
    """Stream one request to the terminal as its chunks arrive.

    With ``field``, each chunk's attribute of that name is written inline (a text delta);
    without, each chunk is a JSON line.
    """
    what = escape(f"field {field}" if field else "chunks")
    console.print(f"[bold]streaming one request[/bold] ({what})")
    out = _Stdout(console)
    found = False
    fields: set[str] = set()
    try:
        async for chunk in pipe.stream(value):
            # With several sinks each chunk says which sent it: its own fields are the value's.
            sink, body = (
                (chunk.stage, chunk.value) if isinstance(chunk, SinkOutput) else ("", chunk)
            )
            if field:
                piece = getattr(body, field, None)
                if isinstance(piece, str):
                    found = True
                    if piece:
                        out.write(f"[{sink}] {piece}\n" if sink else piece)
                else:
                    fields.update(getattr(body, "__struct_fields__", ()))
            else:
                out.write(to_json(_by_sink(sink, body)).decode() + "\n")
    except PipelineError as exc:
        console.print(f"[red]streamed request failed:[/red] {escape(str(exc))}")
    if field:
        out.write("\n")
        if not found and fields:
            console.print(
                f"[yellow]no streamed chunk has a text field {escape(field)!r}[/yellow]; "
                f"theirs: {escape(', '.join(sorted(fields)))}"
            )


async def _master(args: argparse.Namespace, console: Console) -> int:
    """``stagewire master``: wait for the workers, then serve ``submit`` until a signal."""
    pipe = _load(args)
    if len(pipe.plan.sources) != 1:
        raise _Fail(
            f"'master' serves pipelines with one source stage; this one has {pipe.plan.sources}",
            EXIT_CONFIG,
        )
    pipe._serves_clients = True
    await _start(pipe, args, console)
    _collector.settle()
    server = ClientServer(pipe)
    server.install()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # While it serves, either signal stops it in order (exit 0, its figures printed); the
    # handlers before come back for its shutdown, so that a second SIGTERM meanwhile takes
    # Ctrl-C's path instead of killing it outright.
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in before:
        loop.add_signal_handler(sig, stop.set)
    _say(
        console,
        f"serving {pipe.spec.name}: stagewire submit --master {_named(pipe.master_endpoint)} "
        "--input JSON (Ctrl-C stops the master and its workers)",
    )
    try:
        await stop.wait()
    finally:
        for sig, handler in before.items():
            loop.remove_signal_handler(sig)
            if handler is not None:
                signal.signal(sig, handler)
        await server.aclose()
        await pipe.aclose()
    took = server.served + server.failed + server.cancelled + server.abandoned
    console.print(
        f"took {took} request{'' if took == 1 else 's'}: {server.served} completed, "
        f"{server.failed} failed, {server.cancelled} cancelled by their clients, "
        f"{server.abandoned} whose clients went away; workers shut down"
    )
    return 0


async def _submit(args: argparse.Namespace, console: Console) -> int:
    """``stagewire submit``: one request to a running master; each output as a JSON line.

    A :class:`~pipeline.RemotePipeline` underneath: the input is decoded as the source's
    type when this host has the stages' code (else sent as plain JSON values, which the
    master decodes as that type), and each output is printed as JSON as it arrives,
    tensors and arrays summarised (``--device`` says where their tensors are decoded).
    """
    if not args.timeout > 0:
        # Checked first: a timeout of 0 would bound the connecting too, and fail it as if
        # no master answered at --master.
        raise _Fail(
            f"--timeout must be a positive number of seconds, not {args.timeout:g}", EXIT_CONFIG
        )
    from pipeline._worker import master_endpoint_problem

    problem = master_endpoint_problem(args.master)
    if problem is not None:
        raise _Fail(f"--master {args.master!r} {problem}", EXIT_CONFIG)
    if args.device is not None:
        # Checked here too, so that its error names --device and not --master.
        try:
            resolve_device(args.device)
        except ConfigError as exc:
            raise _Fail(f"--device: {exc}", EXIT_CONFIG) from None
    data = _json_input("--input", args.input)
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        raise _Fail(f"--input is not JSON: {exc}", EXIT_CONFIG) from None
    except RecursionError:
        raise _Fail(f"--input: {_TOO_DEEP}", EXIT_CONFIG) from None
    _refuse_wide_ints("--input", value)
    given = value
    keys = _keys_or_fail(args.keys)
    loop = asyncio.get_running_loop()
    reading = asyncio.current_task()
    assert reading is not None
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        reading.cancel()

    loop.add_signal_handler(signal.SIGINT, interrupt)
    deadline = loop.time() + args.timeout
    answered = started = False
    try:
        # Connecting has its own bound, and says so: no master answered, or it refused.
        async with Pipeline.connect(
            args.master,
            timeout=min(10.0, args.timeout),
            keys=keys.directory if keys else None,
            device=args.device,
        ) as pipe:
            answered = True
            async with asyncio.timeout_at(deadline):
                if pipe.source_type is not Any:
                    try:
                        value = msgspec.json.decode(data, type=pipe.source_type)
                    except msgspec.ValidationError as exc:
                        # The user's own input, refused before it is sent: exit code 2.
                        name = getattr(pipe.source_type, "__name__", "the source's type")
                        raise _Fail(
                            f"PayloadError: --input is not a valid {name}: {exc}", EXIT_CONFIG
                        ) from None
                    name = getattr(pipe.source_type, "__name__", "the source's type")
                    known = _field_names(pipe.source_type)
                    _refuse_unknown_fields("--input", given, name, known)
                async with pipe.stream(value) as stream:
                    started = True
                    async for chunk in stream:
                        if isinstance(chunk, SinkOutput):  # several sinks: say which spoke
                            out = _by_sink(chunk.stage, chunk.value)
                        else:
                            out = chunk
                        sys.stdout.write(to_json(out).decode() + "\n")
                        sys.stdout.flush()
        return 0
    except asyncio.CancelledError:
        if not interrupted:
            raise
        # Leaving the stream and the client cancelled the request at the master.
        if _SIGTERM_CAME[0]:
            console.print("terminated: the request was cancelled", markup=False)
            return EXIT_TERMINATED
        console.print("interrupted: the request was cancelled", markup=False)
        return EXIT_INTERRUPTED
    except PayloadError as exc:
        if started:
            raise _submit_failure(exc, args.master, args.timeout, answered=True) from None
        # Refused by the master before it started the request (this host lacks the source's
        # type, so could not check it first): the user's own input, exit code 2 as here.
        raise _Fail(f"PayloadError: --input refused by the master: {exc}", EXIT_CONFIG) from None
    except (TimeoutError, PipelineError) as exc:
        raise _submit_failure(exc, args.master, args.timeout, answered=answered) from None
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def _submit_failure(
    exc: TimeoutError | PipelineError, master: str, timeout: float, *, answered: bool
) -> _Fail:
    """The one-line error and exit code of a ``submit`` that failed with ``exc``.

    A request the pipeline failed, or one that did not end in time once the master had
    answered, is exit code 1; exit code 3 when no master answered at ``master``, it went
    away (:class:`MasterUnavailable`), or it takes no submissions; exit code 2 for an
    endpoint (or keys) that cannot work. The user's own bad ``--input`` is refused (exit
    code 2) before any of this.
    """
    if isinstance(exc, TimeoutError):
        if not answered:
            return _Fail(f"no master answered at {master} within {timeout:g}s", EXIT_START)
        return _Fail(
            f"the request did not end within {timeout:g}s (the master at {master} is slow, "
            "or stopped answering); --timeout waits longer",
            EXIT_FAILED,
        )
    if isinstance(exc, MasterUnavailable):
        return _Fail(str(exc), EXIT_START)
    if isinstance(exc, ConfigError) and not answered:
        return _Fail(f"--master {master!r}: {exc}", EXIT_CONFIG)
    if not answered:
        # The master answered but will not serve this client (a batch ``run``'s master).
        return _Fail(f"{type(exc).__name__}: {exc}", EXIT_START)
    return _Fail(f"{type(exc).__name__}: {exc}", EXIT_FAILED)


def _keys(args: argparse.Namespace, console: Console) -> int:
    """``stagewire keys DIR``: write a new CURVE key pair."""
    try:
        written = make_keys(args.dir, force=args.force)
    except ConfigError as exc:
        raise _Fail(str(exc), EXIT_CONFIG) from None
    directory = Path(written).parent.absolute()
    console.print(
        f"wrote a CURVE key pair to {directory} (secret: {Path(written).name}, readable by "
        f"you only). Give every process of the pipeline the same pair: `stagewire run|master "
        f"CONFIG --keys {directory}`, `stagewire worker ... --keys {directory}`, `stagewire "
        f"submit ... --keys {directory}`, or master.keys in the YAML, or {KEYS_ENV}; copy the "
        "directory to other hosts over a channel you trust.",
        highlight=False,
        markup=False,
        soft_wrap=True,
    )
    return 0


def _validate(args: argparse.Namespace, console: Console) -> int:
    try:
        pipe = Pipeline.from_yaml(args.config)
    except ConfigError as exc:
        raise _Fail(str(exc), EXIT_CONFIG) from exc
    spec = pipe.spec
    if spec.master.keys is not None:
        _keys_or_fail(spec.master.keys)  # as `run` does: a pair that is not there fails it
    console.print(
        f"{args.config}: ok: pipeline {spec.name!r}, {len(spec.stages)} stages, "
        f"{len(spec.edges)} edges, sources {pipe.plan.sources}, sinks {pipe.plan.sinks}",
        markup=False,
        highlight=False,
    )
    return 0


def _version() -> str:
    """The installed distribution's version; ``unknown`` when run from a tree not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stagewire")
    except PackageNotFoundError:
        return "unknown"


def _parser() -> OneLineParser:
    from pipeline._worker import parser as worker_parser

    p = OneLineParser(prog="stagewire", description="Staged inference pipelines.")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.add_argument("--version", action="version", version=f"stagewire {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run", help="run a pipeline over a batch of inputs (workers local, or started elsewhere)"
    )
    run.add_argument("config")
    group = run.add_mutually_exclusive_group()
    group.add_argument("--input", help="one input as JSON")
    group.add_argument("--input-file", help="inputs as JSON lines")
    run.add_argument(
        "--requests",
        type=_count(0, MAX_COUNT),
        default=0,
        help="requests to send, cycling through the inputs (default 0: each input once)",
    )
    run.add_argument(
        "--concurrency", type=_count(1, MAX_COUNT), default=8, help="requests in flight"
    )
    run.add_argument("--print-outputs", action="store_true", help="print every output")
    run.add_argument(
        "--progress-every",
        type=_seconds,
        default=PROGRESS_EVERY_S,
        metavar="SECONDS",
        help="when stderr is not a terminal (a log, CI), a progress line this often "
        f"(default {PROGRESS_EVERY_S:g}; a terminal shows a bar instead)",
    )
    run.add_argument(
        "--external-workers",
        action="store_true",
        help="start no workers here: print the `stagewire worker` command for each replica "
        "and wait (up to defaults.startup_timeout) until every one has registered",
    )
    run.add_argument(
        "--bind",
        metavar="tcp://HOST:PORT",
        help="where the master listens (instead of the config's master.bind)",
    )
    run.add_argument(
        "--show-stream",
        nargs="?",
        const="",
        default=None,
        metavar="FIELD",
        help="first stream one request to the terminal as it is produced; with FIELD, "
        "print that field of each chunk inline (e.g. text_delta)",
    )
    master = sub.add_parser(
        "master",
        help="serve a pipeline to `stagewire submit`, its workers started elsewhere",
    )
    master.add_argument("config")
    master.set_defaults(external_workers=True)
    master.add_argument(
        "--bind",
        metavar="tcp://HOST:PORT",
        help="where the master listens (instead of the config's master.bind)",
    )
    submit = sub.add_parser("submit", help="send one request to a running `stagewire master`")
    submit.add_argument("--master", required=True, metavar="tcp://HOST:PORT")
    submit.add_argument("--input", required=True, help="the input as JSON")
    submit.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait for the request to end"
    )
    submit.add_argument(
        "--device",
        metavar="DEVICE",
        help="decode output tensors onto DEVICE (cpu, cuda:N) instead of the device they were "
        "sent from, e.g. cpu on a host without the master's GPUs",
    )
    for command in (run, master, submit):
        command.add_argument(
            "--keys",
            metavar="DIR",
            help="the pipeline's CURVE key pair (made by `stagewire keys DIR`), which every "
            f"process of the pipeline must be given; default: master.keys, then ${KEYS_ENV}",
        )
    keys = sub.add_parser(
        "keys", help="make a CURVE key pair: every socket of a pipeline given it authenticates"
    )
    keys.add_argument("dir", metavar="DIR", help="directory to write the pair into")
    keys.add_argument("--force", action="store_true", help="replace a pair already there")
    val = sub.add_parser("validate", help="check a pipeline file without starting anything")
    val.add_argument("config")
    sub.add_parser(
        "worker",
        help="serve one stage replica for a master",
        parents=[worker_parser()],
        add_help=False,
    )
    for command in (run, master, submit, keys, val):
        # Also after the command (`stagewire run CONFIG --debug`); set only when given, so
        # that it never overrides a --debug before the command.
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
        )
    return p


def _seconds(text: str) -> float:
    """An argparse type: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _count(least: int, most: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``least`` to ``most``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is below {least}")
        if value > most:
            raise argparse.ArgumentTypeError(f"{value} is above {most}")
        return value

    return parse


def _one_line(message: str) -> str:
    """An error message on one line (a stage's multi-line error, say)."""
    return re.sub(r"\s*\n\s*", " | ", message.strip())


def _report_error(console: Console, exc: BaseException, code: int, *, debug: bool) -> int:
    """Print ``exc`` as one line (after its traceback, with ``--debug``); returns ``code``.

    The traceback is shown, not re-raised, so that ``--debug`` keeps the exit code.
    """
    if debug:
        try:
            traceback.print_exception(exc, file=sys.stderr)
            sys.stderr.flush()
        except OSError:  # its reader has gone: the exit status still says what happened
            _to_devnull(sys.stderr)
    console.print(
        f"[red]error:[/red] {escape(_one_line(str(exc)))}", highlight=False, soft_wrap=True
    )
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the ``stagewire`` command; returns the exit code.

    SIGTERM (what service managers stop a process with) takes Ctrl-C's path: the pipeline
    shuts down in order, workers included, and the command exits 143 saying so.
    """
    argv = sys.argv[1:] if argv is None else argv
    worker = worker_argv(argv)
    if worker is not None:
        from pipeline._worker import main as worker_main

        return worker_main(worker)
    _stderr_or_devnull()
    terminated = _on_sigterm_interrupt()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # A Ctrl-C (or SIGTERM) before the command's own handling began, or after it ended.
        return _interrupted(terminated)
    except BrokenPipeError:
        # Whoever read stdout stopped (``| head``): nothing more is written there.
        _quiet_stdout()
        return EXIT_FAILED


#: Holds True once a SIGTERM came (see _on_sigterm_interrupt): a command that handles the
#: interrupt itself says which signal it was.
_SIGTERM_CAME = [False]


def _on_sigterm_interrupt() -> list[bool]:
    """Make SIGTERM interrupt as SIGINT does; the list returned holds True once one came."""
    came = _SIGTERM_CAME
    came[0] = False

    def on_term(signum: int, frame: object) -> None:
        came[0] = True
        if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
            # SIGINT inherited as ignored (a background job of a script): a raised SIGINT
            # would be dropped, and asyncio took no handler for it. This is what Python's
            # own SIGINT handler does.
            raise KeyboardInterrupt
        signal.raise_signal(signal.SIGINT)

    signal.signal(signal.SIGTERM, on_term)
    return came


def _interrupted(terminated: list[bool]) -> int:
    with contextlib.suppress(OSError, ValueError):  # (a stderr whose reader has gone)
        sys.stderr.write("terminated\n" if terminated[0] else "interrupted\n")
        sys.stderr.flush()
    return EXIT_TERMINATED if terminated[0] else EXIT_INTERRUPTED


def _stderr_or_devnull() -> None:
    """Give a command started with its stderr closed (``2>&-``) one that goes nowhere, for
    itself and the workers it starts: its console and its log write there, and would fail
    the command before it did anything, its outputs lost and its exit status wrong."""
    if sys.stderr is not None:
        return
    with contextlib.suppress(OSError):
        fd = os.open(os.devnull, os.O_WRONLY)
        if fd != 2:
            os.dup2(fd, 2)  # (inheritable)
            os.close(fd)
        else:
            os.set_inheritable(2, True)  # the workers' stderr too
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115 - for the process's life


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit does not fail again."""
    _to_devnull(sys.stdout)


def _to_devnull(stream: TextIO | None) -> None:
    """Point ``stream``'s descriptor at /dev/null: what is still buffered, and all that is
    written later (by this process or a worker sharing it), goes nowhere, without errors."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, stream.fileno())  # type: ignore[union-attr]
        finally:
            os.close(devnull)


class _Console(Console):
    """The command's console, on stderr. Once its reader has gone (``2>&1 | head``), the
    rest is dropped and the command goes on to its own exit status (rich exits 1)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        _to_devnull(sys.stderr)


def _say(console: Console, text: str) -> None:
    """Write ``text`` as a line to the console as it is (no markup, never wrapped)."""
    console.print(text, markup=False, highlight=False, emoji=False, soft_wrap=True)


def _main(argv: list[str]) -> int:
    args = _parser().parse(argv)
    if args.command in ("run", "master"):
        # Off while the stages' modules import and the workers start (see _collector).
        _collector.pause()
    configure_logging()
    # Off a terminal (CI logs, pipes) keep table rows and error lines unwrapped.
    console = _Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    try:
        if args.command == "validate":
            return _validate(args, console)
        if args.command == "master":
            return asyncio.run(_master(args, console))
        if args.command == "submit":
            return asyncio.run(_submit(args, console))
        if args.command == "keys":
            return _keys(args, console)
        return asyncio.run(_run(args, console))
    except _Fail as exc:
        if args.debug:
            cause = exc.__cause__
            if isinstance(cause, PipelineError) and cause.traceback:
                console.print(f"stage traceback:\n{cause.traceback}", highlight=False, markup=False)
        return _report_error(console, exc, exc.code, debug=args.debug)
    except PayloadError as exc:
        return _report_error(console, exc, EXIT_CONFIG, debug=args.debug)
