"""An embedded pipeline's life: one start at a time, one event loop, and a close that
stops every worker however it is reached (twice at once, cancelled, from another loop,
after its own loop has closed)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TypeVar

import pytest
import zmq

from pipeline import Pipeline, PipelineError, StageUnavailable
from pipeline import _launcher as launcher_module
from pipeline._lifecycle import interrupts_deferred
from stages.text import Text, Token
from tests.pipeline.conftest import spec, wait_for
from tests.procs import alive, wait_exited
from transports._shm_segment import _pid_of, list_segments
from transports.shm import remove_segments_of

T = TypeVar("T")


ROOT = Path(__file__).resolve().parents[2]


def _relay() -> Pipeline:
    return Pipeline(spec({"tok": ":Tokens", "relay": ":Relay"}, [("tok", "relay")]))


async def _gone(pids: list[int], timeout: float = 15.0) -> None:
    await wait_for(lambda: not any(alive(p) for p in pids), timeout)


def _in_thread(make: Callable[[], Awaitable[T]]) -> T | BaseException:
    """Run ``make()`` on an event loop of its own in another thread: its result or error."""
    out: list[T | BaseException] = []

    def run() -> None:
        async def main() -> T:
            return await make()

        try:
            out.append(asyncio.run(main()))
        except BaseException as exc:  # handed back to the test
            out.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    assert out, "the other loop's work did not end within 60 s"
    return out[0]


async def test_a_running_pipeline_refuses_a_second_start() -> None:
    """Entering ``async with`` again started a second master and workers and orphaned the
    first set; now it is refused, and the running pipeline goes on."""
    async with _relay() as pipe:
        pids = list(pipe.worker_pids.values())
        with pytest.raises(RuntimeError, match="already running"):
            async with pipe:
                pass
        assert list(pipe.worker_pids.values()) == pids
        assert await pipe.submit(Text("a b")) == Token(1, "b")
    await _gone(pids)
    with pytest.raises(RuntimeError, match="closed"):
        await pipe.submit(Text("late"))


async def test_two_closes_at_once_both_wait_for_the_workers() -> None:
    """An explicit ``aclose`` beside ``__aexit__``'s: neither returns before the workers
    have exited (the first used to return as soon as it had closed the master)."""
    pipe = _relay()
    await pipe.start()
    pids = list(pipe.worker_pids.values())
    left: list[list[int]] = []

    async def close() -> None:
        await pipe.aclose()
        left.append([p for p in pids if alive(p)])

    await asyncio.wait_for(asyncio.gather(close(), close()), 30)
    assert left == [[], []]


async def test_a_close_whose_caller_is_cancelled_still_stops_the_workers() -> None:
    """A shutdown deadline fires while the close waits for a busy worker: the close goes
    on, and the pipeline still knows the pids until the workers are gone."""
    pipe = Pipeline(spec({"hog": ":Hog"}, []))
    await pipe.start()
    pids = list(pipe.worker_pids.values())
    busy = asyncio.ensure_future(pipe.submit(Text("30")))  # holds the worker's loop 30 s
    await wait_for(lambda: pipe._master_or_fail().orch.statistics()["active"] == 1, 10)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(pipe.aclose(), 0.5)
    assert pipe.worker_pids  # still tracked while the close goes on
    await asyncio.gather(busy, return_exceptions=True)
    await _gone(pids)
    await asyncio.wait_for(pipe.aclose(), 5)  # the same close, done


def _no_pidfd(pid: int, flags: int = 0) -> int:
    raise OSError(errno.EMFILE, "Too many open files")


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfds", "no-pidfds"])
def test_a_close_cancelled_as_its_loop_ends_kills_the_workers(pidfds: bool) -> None:
    """``asyncio.run`` ends while the close waits for a busy worker, cancelling it: the
    workers are killed then, not left running with nobody to stop them; so is a worker
    whose pidfd could not be opened (the process was out of descriptors), by its pid."""
    pipe = Pipeline(spec({"hog": ":Hog"}, []))
    pids: list[int] = []

    async def main() -> None:
        await pipe.start()
        pids.extend(pipe.worker_pids.values())
        busy = asyncio.ensure_future(pipe.submit(Text("30")))
        await wait_for(lambda: pipe._master_or_fail().orch.statistics()["active"] == 1, 10)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pipe.aclose(), 0.5)
        busy.cancel()

    with pytest.MonkeyPatch.context() as patch:
        if not pidfds:
            patch.setattr(os, "pidfd_open", _no_pidfd)
        asyncio.run(main())  # cancels the close still running
    assert pids and wait_exited(pids, 5)


def test_a_close_cancelled_while_the_master_closes_kills_the_workers_at_once() -> None:
    """``asyncio.run`` ends while the close is still closing the master (before the
    launcher's turn), a worker busy: the workers are killed at once. The cancellation went
    to the master's close, and the launcher's close then waited out the whole grace (5 s,
    then SIGTERM) as if nothing had been cancelled."""
    pipe = Pipeline(spec({"hog": ":Hog"}, []))
    pids: list[int] = []
    inside: list[bool] = []
    ended: list[float] = []

    stopping: list[bool] = []

    async def main() -> None:
        await pipe.start()
        pids.extend(pipe.worker_pids.values())
        launcher = pipe._launcher
        assert launcher is not None
        stop_workers = launcher.aclose

        async def recorded(grace: float = 5.0) -> None:
            stopping.append(True)
            await stop_workers(grace)

        patch.setattr(launcher, "aclose", recorded)
        busy = asyncio.ensure_future(pipe.submit(Text("30")))
        await wait_for(lambda: pipe._master_or_fail().orch.statistics()["active"] == 1, 10)
        closing = asyncio.ensure_future(pipe.aclose())  # asyncio.run cancels it as it ends
        for _ in range(3):
            await asyncio.sleep(0)  # the close task takes the master and begins its close
        assert not closing.done()
        inside.append(pipe._master is None and pipe._launcher is launcher and not stopping)
        busy.cancel()
        ended.append(time.monotonic())

    with pytest.MonkeyPatch.context() as patch:
        asyncio.run(main())  # cancels the close still running
    took = time.monotonic() - ended[0]
    assert inside == [True], "the close was not inside the master's close when cancelled"
    assert pids and wait_exited(pids, 5)
    assert took < 3.0, f"the cancelled close went on for {took:.1f}s"


def _segments_of(pids: list[int]) -> list[str]:
    return [name for name in list_segments() if _pid_of(name) in pids]


def test_a_ctrl_c_while_the_workers_are_killed_waits_until_their_memory_is_gone() -> None:
    """A Ctrl-C that lands while a close that cannot wait kills the workers and unlinks
    the shared memory they leave (a third Ctrl-C in a row: the second cut the close short)
    raises its KeyboardInterrupt once that is done. (It cut the unlinking off: a killed
    worker's segment stayed in /dev/shm until a later stagewire process swept it.)"""
    pipe = Pipeline(
        spec({"tok": ":Tokens", "relay": ":Relay"}, [("tok", "relay")], transport="shm")
    )
    pids: list[int] = []
    unlink = launcher_module.remove_leftovers_of

    def interrupted_first(dead: Iterable[int]) -> None:
        signal.raise_signal(signal.SIGINT)  # the Ctrl-C lands here
        unlink(dead)

    async def main() -> None:
        await pipe.start()
        pids.extend(pipe.worker_pids.values())
        assert _segments_of(pids), "the pinned shm edge took no segment at start-up"
        launcher = pipe._launcher
        assert launcher is not None
        # What a Ctrl-C does once asyncio's handler has cancelled the run: raise at once.
        before = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(launcher_module, "remove_leftovers_of", interrupted_first)
                with pytest.raises(KeyboardInterrupt):
                    launcher.kill_now()
        finally:
            signal.signal(signal.SIGINT, before)
        # Before the pipeline's own close, which would unlink them anyway.
        left = _segments_of(pids)
        await pipe.aclose()
        assert not left

    try:
        asyncio.run(main())
        assert wait_exited(pids, 5)
    finally:
        remove_segments_of([p for p in pids if not alive(p)])


def test_interrupts_deferred_holds_a_ctrl_c_until_the_body_is_done() -> None:
    """The KeyboardInterrupt of a Ctrl-C inside the body comes after the body, once; none
    comes without one, and the handler before is back afterwards."""
    done: list[str] = []
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_deferred():  # noqa: PT012
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            done.append("body")
        assert done == ["body"]
        with interrupts_deferred():
            done.append("quiet")
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert done == ["body", "quiet"]


async def test_starting_a_pipeline_that_is_closing_says_so() -> None:
    """``start()`` while the close is under way says the pipeline is still closing (it said
    it was already running, as the launcher was still there)."""
    pipe = Pipeline(spec({"echo": ":Echo"}, []))
    await pipe.start()
    closing = asyncio.ensure_future(pipe.aclose())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="still closing"):
        await pipe.start()
    await asyncio.wait_for(closing, 30)


def test_workers_outlive_the_thread_that_started_them() -> None:
    """A pipeline started from a thread that then ends (a thread pool's, a per-request
    thread's in a synchronous service) keeps its workers: they watch for the end of the
    starting process, not of its thread. They used to get the kernel's parent-death
    signal as that thread ended, and, exiting 0 as if told to, were never restarted."""
    loop = asyncio.new_event_loop()
    pipe = Pipeline(spec({"echo": ":Echo"}, [], heartbeat_timeout="10s"))
    try:
        starter = threading.Thread(target=loop.run_until_complete, args=(pipe.start(),))
        starter.start()
        starter.join()
        pids = list(pipe.worker_pids.values())
        assert pids and not wait_exited(pids, 2), "a worker ended with the starting thread"
        served = loop.run_until_complete(asyncio.wait_for(pipe.submit(Text("still")), 30))
        assert served == Text("still")
    finally:
        loop.run_until_complete(pipe.aclose())
        loop.close()
    assert wait_exited(pids, 10)


async def test_a_pipeline_is_used_from_the_loop_that_started_it_only() -> None:
    """Another loop's submit is refused with a clear error (it used to work, binding the
    pipeline's sockets to that loop, so that closing it on its own loop then failed and
    left the workers running); another loop's close closes it on its own loop."""
    pipe = _relay()
    await pipe.start()
    pids = list(pipe.worker_pids.values())
    got = await asyncio.to_thread(_in_thread, lambda: pipe.submit(Text("x")))
    assert isinstance(got, RuntimeError) and "another event loop" in str(got), got
    assert await pipe.submit(Text("a b")) == Token(1, "b")
    assert await asyncio.to_thread(_in_thread, pipe.aclose) is None
    await _gone(pids)
    await pipe.aclose()


def test_a_pipeline_whose_loop_closed_says_so_and_is_closed_from_another() -> None:
    """A pipeline left open when its ``asyncio.run`` ended: a submit on a new loop hung,
    and ``aclose`` raised "Event loop is closed", stopping nothing. Now the submit says
    what happened, and ``aclose`` kills the workers and closes the sockets at once."""
    pipe = _relay()
    pids: list[int] = []

    async def start() -> None:
        await pipe.start()
        pids.extend(pipe.worker_pids.values())

    asyncio.run(start())

    async def later() -> None:
        with pytest.raises(RuntimeError, match="has closed"):
            await pipe.submit(Text("x"))
        await asyncio.wait_for(pipe.aclose(), 10)

    asyncio.run(later())
    assert pids and not any(alive(p) for p in pids)


async def test_a_start_whose_on_listening_raises_closes_what_it_started() -> None:
    """An ``on_listening`` callback that raises fails the start, which closes the master it
    had bound (its sockets and heartbeat task were left running, and every later start was
    refused as "already running")."""
    pipe = Pipeline(spec({"echo": ":Echo"}, []))

    def refuse(endpoint: str) -> None:
        raise OSError(f"cannot announce {endpoint}")

    with pytest.raises(OSError, match="cannot announce"):
        await pipe.start(on_listening=refuse)
    assert pipe._master is None and pipe._launcher is None
    async with pipe:
        assert await pipe.submit(Text("again")) == Text("again")


async def test_a_start_whose_socket_watch_cannot_be_made_closes_without_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The master watches each of its two bound sockets for refused handshakes. When the
    second watch could not be made (out of descriptors), the first was never closed, and
    its monitor held the ZMQ context's termination, so the failed start's close, and the
    process's exit, hung for ever. The start now fails, and closes, at once."""
    from pipeline import _master

    made: list[object] = []

    def second_fails(sock: object, on_refused: object) -> object:
        if made:
            raise zmq.ZMQError(errno.EMFILE)
        made.append(real(sock, on_refused))  # type: ignore[arg-type]
        return made[-1]

    real = _master.RefusedPeers
    monkeypatch.setattr(_master, "RefusedPeers", second_fails)
    pipe = Pipeline(spec({"echo": ":Echo"}, []))
    async with asyncio.timeout(30):
        with pytest.raises(zmq.ZMQError):
            await pipe.start()
    assert pipe._master is None and pipe._launcher is None
    monkeypatch.undo()
    async with asyncio.timeout(60), pipe:
        assert await pipe.submit(Text("again")) == Text("again")


async def test_a_watch_that_fires_late_leaves_a_pipeline_started_since_alone() -> None:
    """The watch of a loop that closed fires after the pipeline was closed and started
    again on another loop: it must not close the new one (it closed whatever the pipeline
    held when it fired: the new workers and master)."""
    async with _relay() as pipe:
        stale = pipe._watch
        assert stale is not None
        pipe._watch = None  # as if closed and started again: a new watch took its place
        pipe._abandoned(stale)
        assert pipe._master is not None and pipe.worker_pids
        assert await pipe.submit(Text("a b")) == Token(1, "b")
        pipe._watch = stale


def test_a_loop_closed_while_its_pipeline_starts_is_cleaned_up_by_the_watch() -> None:
    """A loop closed by hand while ``start()`` still waits for a worker: the watch closes
    the pipeline, its workers and the master's sockets. (Waking the start's waiter, on the
    closed loop, raised in the watch's thread before the sockets were closed.)"""
    pipe = Pipeline(spec({"h": ":HangingSetup"}, [], heartbeat_interval="100ms",
                         heartbeat_timeout="1s", startup_timeout="60s"))  # fmt: skip
    loop = asyncio.new_event_loop()
    starting = loop.create_task(pipe.start())
    loop.run_until_complete(wait_for(lambda: bool(pipe.worker_pids), 30))
    pids, master = list(pipe.worker_pids.values()), pipe._master
    assert pids and master is not None and not starting.done()
    loop.close()
    assert wait_exited(pids, 15), pids
    asyncio.run(wait_for(lambda: master.zctx.closed, 15))  # the watch closes it next
    assert pipe._master is None
    # Its loop is closed: the start can never finish (closing it now, not at a garbage
    # collection, keeps its complaint about that out of other tests).
    with contextlib.suppress(RuntimeError):
        starting.get_coro().close()  # type: ignore[union-attr]


async def test_a_start_that_fails_stops_its_workers_without_a_grace_period() -> None:
    """Workers that never became ready cannot act on the master's Shutdown: the failed
    start stops them at once instead of waiting 5 s for them first."""
    pipe = Pipeline(spec({"h": ":HangingSetup"}, [], startup_timeout="1s"))
    began = time.monotonic()
    with pytest.raises(StageUnavailable, match="not ready"):
        await pipe.start()
    # 1 s of start-up timeout, then SIGTERM; a grace period first made it 6 s at least.
    assert time.monotonic() - began < 5.0
    assert not pipe.worker_pids


async def test_a_close_during_start_ends_the_start_and_leaves_nothing() -> None:
    """A close while the start still spawns workers: the start fails saying so, the close
    returns promptly, and no worker is left (those spawned after the close began were left
    running, and the close waited minutes for them)."""
    pipe = Pipeline(spec({"echo": {"impl": ":Echo", "replicas": 6}}, []))
    starting = asyncio.ensure_future(pipe.start())
    await wait_for(lambda: len(pipe.worker_pids) >= 1, 20, interval=0.001)
    launcher = pipe._launcher
    assert launcher is not None
    await asyncio.wait_for(pipe.aclose(), 15)
    with pytest.raises(PipelineError, match="closed while it started"):
        await asyncio.wait_for(starting, 15)
    await _gone(list(launcher.started))


async def test_a_close_task_cancelled_midway_leaves_nothing_and_later_closes_quiet() -> None:
    """A shutdown handler cancels every task while the close waits for a busy worker: the
    workers are killed and the sockets closed then, and a later aclose returns quietly
    (it raised the stored CancelledError)."""
    pipe = Pipeline(spec({"hog": ":Hog"}, []))
    await pipe.start()
    pids = list(pipe.worker_pids.values())
    busy = asyncio.ensure_future(pipe.submit(Text("30")))
    await wait_for(lambda: pipe._master_or_fail().orch.statistics()["active"] == 1, 10)
    master = pipe._master_or_fail()
    closing = asyncio.ensure_future(pipe.aclose())
    # The master closed, the launcher's grace period begins: the worker is busy for 30 s.
    await wait_for(lambda: master.router.closed, 10)
    assert pipe._closing is not None
    pipe._closing.cancel()
    await asyncio.gather(closing, busy, return_exceptions=True)
    assert not any(alive(p) for p in pids)
    await asyncio.wait_for(pipe.aclose(), 5)


_DROPPED = """
import asyncio, gc, sys
from pipeline import Pipeline
from stages.text import Text
from tests.pipeline.conftest import spec

async def main():
    pipe = Pipeline(spec({"echo": ":Echo"}, []))
    await pipe.start()
    assert await pipe.submit(Text("x")) == Text("x")
    print(*pipe.worker_pids.values(), flush=True)

asyncio.run(main())  # the pipeline is dropped, never closed
gc.collect()
print("collected", flush=True)
"""


def test_a_pipeline_dropped_unclosed_does_not_freeze_a_garbage_collection() -> None:
    """Its ZMQ context and sockets became garbage together; the collector clears weak
    references first, so pyzmq's finaliser found no socket to close and waited for them
    for ever: the next collection froze the process (a service that lost track of one)."""
    done = subprocess.run(
        [sys.executable, "-c", _DROPPED], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "collected", done.stderr
    # The workers go with their parent.
    assert wait_exited(map(int, done.stdout.split()[:-1]), 30)


async def test_a_heartbeat_interval_past_what_a_thread_waits_is_no_crash() -> None:
    """The thread that watches for the loop's close waits a heartbeat interval at a time:
    one past ``threading.TIMEOUT_MAX`` (the config takes any) killed it with an
    OverflowError, and nothing watched the loop any more."""
    from pipeline._lifecycle import LoopWatch

    crashed: list[threading.ExceptHookArgs] = []
    before = threading.excepthook
    threading.excepthook = crashed.append
    try:
        watch = LoopWatch(asyncio.get_running_loop(), 1e12, lambda _: None)
        await asyncio.sleep(0)
        assert watch._thread.is_alive()
        watch.stop()
    finally:
        threading.excepthook = before
    assert not crashed


#: Starts a pipeline, forks a child that waits on stdin (as a service's multiprocessing
#: pool would run), prints the workers' and the child's pids, and waits to be killed.
_FORKS = """
import asyncio, os, sys
from pipeline import Pipeline
from tests.pipeline.conftest import spec

async def main():
    pipe = Pipeline(spec({"echo": ":Echo"}, [], heartbeat_timeout="60s"))
    await pipe.start()
    child = os.fork()
    if child == 0:
        os.read(0, 1)
        os._exit(0)
    print(*pipe.worker_pids.values(), child, flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_workers_end_with_their_master_though_a_child_forked_from_it_lives() -> None:
    """Workers watch a pipe only their master's process holds open, and end at its end of
    file. A child forked from that process (``os.fork``, a multiprocessing pool) inherited
    the pipe's write end, and while it lived a master killed -9 left its workers running
    (for twice the heartbeat timeout, 2 minutes here). The child now closes it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _FORKS],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, pids
        proc.kill()
        proc.wait()
        assert alive(pids[1]), "the forked child ended with its parent"
        assert wait_exited(pids[:1], 15), "the worker outlived its master"
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the forked child's stdin: it reads its end and exits
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                if not wait_exited([pid], 5):
                    os.kill(pid, 9)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
