"""New requests and a stage with no ready replica: they wait for one (``replica_wait``)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import structlog.testing

from pipeline import Pipeline, RequestAborted, StageUnavailable
from stages.text import Text
from tests.pipeline.conftest import spec, wait_for
from tests.procs import children

KEY = ("echo", 0)


async def _crash(pipe: Pipeline) -> int:
    """kill -9 the only echo replica and wait until the master has declared it dead."""
    victim = pipe.worker_pids[KEY]
    os.kill(victim, signal.SIGKILL)
    view = pipe._master_or_fail().orch.replicas["echo"][0]
    await wait_for(lambda: not view.ready)
    return victim


async def test_a_request_waits_while_the_only_replica_restarts() -> None:
    """A request made while the stage's only replica is being restarted after kill -9 is
    served by the new replica instead of failing."""
    async with Pipeline(spec({"echo": ":Echo"}, [])) as pipe:
        victim = await _crash(pipe)
        assert await pipe.submit(Text("back")) == Text("back")
        assert pipe.worker_pids[KEY] != victim
        assert (await pipe.statistics())["client"]["waited"] == 1


async def test_a_zero_replica_wait_fails_at_once() -> None:
    """With ``replica_wait: 0s`` the request fails as soon as it finds no ready replica."""
    async with Pipeline(spec({"echo": ":Echo"}, [], replica_wait="0s")) as pipe:
        await _crash(pipe)
        t0 = time.monotonic()
        with pytest.raises(StageUnavailable, match=r"no replica is ready$"):
            await pipe.submit(Text("x"))
        assert time.monotonic() - t0 < 0.2
        assert (await pipe.statistics())["client"]["waited"] == 0


async def test_the_wait_is_bounded() -> None:
    """A replica that never comes back (stopped, declared dead by its silence, never
    restarted) fails the waiting request after ``replica_wait``, naming the stage."""
    async with Pipeline(spec({"echo": ":Echo"}, [], replica_wait="500ms")) as pipe:
        # As for a worker started elsewhere: nobody here ends it once it is declared dead.
        pipe._master_or_fail().on_silent = None
        victim = pipe.worker_pids[KEY]
        os.kill(victim, signal.SIGSTOP)
        try:
            view = pipe._master_or_fail().orch.replicas["echo"][0]
            await wait_for(lambda: not view.ready)  # after the 2 s heartbeat timeout
            t0 = time.monotonic()
            with pytest.raises(StageUnavailable, match=r"'echo'.*after waiting 0\.5s"):
                await pipe.submit(Text("x"))
            assert 0.45 < time.monotonic() - t0 < 3
        finally:
            os.kill(victim, signal.SIGKILL)


async def test_closing_ends_a_waiting_request() -> None:
    """Closing the pipeline while a request waits for a replica aborts that request at
    once, and leaves no process behind."""
    pipe = Pipeline(spec({"echo": ":Echo"}, [], replica_wait="60s"))
    await pipe.start()
    try:
        await _crash(pipe)
        waiting = asyncio.ensure_future(pipe.submit(Text("x")))
        await wait_for(lambda: pipe._master_or_fail().orch.counts["waited"] == 1)
    finally:
        t0 = time.monotonic()
        await pipe.aclose()
    with pytest.raises(RequestAborted, match="closing"):
        await asyncio.wait_for(waiting, 5)
    assert time.monotonic() - t0 < 10
    await wait_for(lambda: not children(os.getpid()))


async def test_no_wait_for_a_replica_that_will_not_be_restarted() -> None:
    """Once the launcher gives a crashed replica up (its restarts spent), new requests fail
    at once instead of waiting out ``replica_wait`` for nothing."""
    async with Pipeline(spec({"echo": ":Echo"}, [], replica_wait="60s")) as pipe:
        launcher = pipe._launcher
        assert launcher is not None
        launcher._max_restarts = 0  # as if every restart had been spent
        await _crash(pipe)
        view = pipe._master_or_fail().orch.replicas["echo"][0]
        await wait_for(lambda: view.given_up)
        t0 = time.monotonic()
        with pytest.raises(StageUnavailable, match="none is being restarted"):
            await pipe.submit(Text("x"))
        assert time.monotonic() - t0 < 0.5


async def test_a_waiting_request_cancelled_by_its_caller_gives_its_slot_back() -> None:
    """Cancelling a submit that waits for a replica ends it at once; its admission slot
    comes back (with one slot in all, the next request still runs once the replica is)."""
    async with Pipeline(spec({"echo": ":Echo"}, [], max_inflight=1, replica_wait="60s")) as pipe:
        await _crash(pipe)
        waiting = asyncio.ensure_future(pipe.submit(Text("x")))
        await wait_for(lambda: pipe._master_or_fail().orch.counts["waited"] == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await asyncio.wait_for(pipe.submit(Text("next")), 30) == Text("next")
        assert (await pipe.statistics())["client"]["active"] == 0


async def test_a_cancel_landing_as_the_replica_becomes_ready_is_kept() -> None:
    """A caller's cancel that lands in the loop turn in which the awaited replica becomes
    ready (its Ready and a client's timeout together) ends the submit. The wait for the
    replica used ``asyncio.wait_for``, which on Python 3.11 returns the result then and
    loses the cancel: the request was admitted and ran to its end."""
    async with Pipeline(spec({"echo": ":Echo"}, [], replica_wait="60s")) as pipe:
        orch = pipe._master_or_fail().orch
        orch.replicas["echo"][0].ready = False  # as while its worker restarts
        waiting = asyncio.ensure_future(pipe.submit(Text("x")))
        await wait_for(lambda: orch.counts["waited"] == 1)
        orch.replica_ready("echo", 0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiting, 30)
        assert orch.counts["submitted"] == orch.counts["completed"] + orch.counts["aborted"]
        assert orch.counts["completed"] == 0
        assert await asyncio.wait_for(pipe.submit(Text("next")), 30) == Text("next")


async def test_a_hung_worker_is_ended_and_its_slot_restarted() -> None:
    """A local worker declared dead for its silence (hung: stopped here) is killed by the
    launcher that started it, and restarted: the slot serves again."""
    async with Pipeline(spec({"echo": ":Echo"}, [])) as pipe:
        victim = pipe.worker_pids[KEY]
        os.kill(victim, signal.SIGSTOP)
        try:
            view = pipe._master_or_fail().orch.replicas["echo"][0]
            await wait_for(lambda: not view.ready)  # after the 2 s heartbeat timeout
            # replica_wait (10 s) covers the restart.
            assert await pipe.submit(Text("back")) == Text("back")
            assert pipe.worker_pids[KEY] != victim
            assert not any(p == victim for p in children(os.getpid()))
        finally:
            if victim in children(os.getpid()):
                os.kill(victim, signal.SIGKILL)


async def test_the_restart_budget_renews_once_a_restarted_worker_has_run_a_while() -> None:
    """Crashes far apart never use up the restart budget: a worker that ran ``stable_s``
    before it crashed is restarted even when the budget was spent before. (``stable_s`` is
    0 here, so every worker has run long enough by the time it crashes; with a budget of
    one restart, the second crash used to lose the slot.)"""
    async with Pipeline(spec({"echo": ":Echo"}, [])) as pipe:
        launcher = pipe._launcher
        assert launcher is not None
        launcher._max_restarts, launcher._stable_s = 1, 0.0
        for crash in range(3):
            await _crash(pipe)
            assert await pipe.submit(Text(f"after crash {crash}")) == Text(f"after crash {crash}")
            assert launcher.restarts[KEY] == 1


async def test_a_setup_that_fails_at_a_restart_is_retried(tmp_path: Path) -> None:
    """A restarted worker whose setup fails (a transient error) is restarted again, within
    the budget, instead of losing its slot for good; the master logs why the setup failed
    (a worker a launcher started leaves that to its master)."""
    stage = {"impl": ":FlakySetup", "env": {"FLAKY_MARKER": str(tmp_path / "starts")}}
    async with Pipeline(spec({"echo": stage}, [])) as pipe:
        with structlog.testing.capture_logs() as logs:
            await _crash(pipe)
            assert await pipe.submit(Text("back")) == Text("back")
        assert (tmp_path / "starts").read_text() == "failed once"
        assert pipe._launcher is not None and pipe._launcher.restarts[KEY] == 2
        failed = [e for e in logs if e["event"] == "stage_setup_failed"]
        assert [e["stage"] for e in failed] == ["echo"] and "error" in failed[0], logs


@pytest.mark.parametrize("given_up", [False, True], ids=["restarting", "given up"])
async def test_a_request_waiting_in_vain_is_told_why_the_stage_has_no_replica(
    tmp_path: Path, given_up: bool
) -> None:
    """A request that finds no ready replica fails saying why the stage's replicas went:
    here each restart's setup fails, which the master knew at once (it used to leave the
    slot registered but not ready until its start-up timeout), while the request failed
    with "no replica is ready after waiting", nothing more."""
    stage = {"impl": ":BreaksWhenRestarted", "env": {"BREAK_MARKER": str(tmp_path / "m")}}
    async with Pipeline(spec({"echo": stage}, [], replica_wait="500ms")) as pipe:
        launcher = pipe._launcher
        assert launcher is not None
        launcher._max_restarts = 1 if given_up else 100
        orch = pipe._master_or_fail().orch
        await _crash(pipe)
        await wait_for(lambda: "failed its setup" in orch.replicas["echo"][0].why, 30)
        if given_up:
            await wait_for(lambda: orch.replicas["echo"][0].given_up, 30)
            says = r"none is being restarted \(replica 0 failed its setup: OSError: weights"
        else:
            says = r"after waiting 0\.5s \(replica 0 failed its setup: OSError: weights"
        with pytest.raises(StageUnavailable, match=says):
            await asyncio.wait_for(pipe.submit(Text("x")), 30)


async def test_an_exit_of_a_process_that_no_longer_holds_the_slot_is_ignored() -> None:
    """The exit of a process whose slot another worker has taken since (registered in its
    place) does not declare that worker dead: only the slot's holder can die for it."""
    async with Pipeline(spec({"echo": ":Echo"}, [])) as pipe:
        master = pipe._master_or_fail()
        holder = pipe.worker_pids[KEY]
        master.replica_lost("echo", 0, "exited with code -9", holder + 100_000)
        assert master.replicas[KEY].alive and master.orch.replicas["echo"][0].ready
        assert await pipe.submit(Text("still here")) == Text("still here")
        master.replica_lost("echo", 0, "exited with code -9", holder)
        assert not master.replicas[KEY].alive
