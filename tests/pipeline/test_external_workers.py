"""``stagewire run --external-workers``: a master that launches nothing, and headless
``stagewire worker`` processes started by hand (here, by the test) that find it.

Real processes and sockets on the loopback address: the run prints where it listens and
the command for each replica, waits for them, serves the batch, and shuts the workers down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline._exit_codes import EXIT_REPLACED
from pipeline._host import address_toward, tcp_endpoint
from pipeline._messages import Heartbeat
from tests.pipeline.conftest import wait_for, workers_announced
from tests.procs import alive, free_port, kill_all, start_stagewire
from transports._shm_segment import PREFIX, list_segments

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"
INPUTS = ROOT / "configs" / "demo-inputs.jsonl"


def _start(
    *args: str, err: Path, out: Path | None = None, host: str | None = None
) -> subprocess.Popen[bytes]:
    """``python -m pipeline ARGS``; with ``host``, as if on that host (its own host
    identity: no shm, no same-host links)."""
    env = dict(os.environ)
    if host is not None:
        env["STAGEWIRE_HOST_ID"] = host
    return start_stagewire(*args, err=err, out=out, env=env)


@pytest.mark.parametrize("hosts", ["one host", "a host each"])
async def test_a_run_with_external_workers_serves_them_and_shuts_them_down(
    tmp_path: Path, hosts: str
) -> None:
    """The workers on the master's host, or each as if on a host of its own (loopback
    addresses, distinct host identities), so that every edge crosses hosts."""
    err, out = tmp_path / "run.err", tmp_path / "run.out"
    procs = [
        _start(
            "run", str(DEMO), "--external-workers", "--bind", "tcp://127.0.0.1:0",
            "--input-file", str(INPUTS), "--requests", "40", "--print-outputs",
            err=err, out=out,
        )
    ]  # fmt: skip
    try:
        await workers_announced(err)
        text = err.read_text()
        found = re.findall(r"stagewire worker (--master \S+ --stage (\S+) --replica \d+)", text)
        assert sorted(stage for _, stage in found) == ["join", "split", "upper"], text
        commands = [command for command, _ in found]
        # Nothing was launched: the run waits for the workers it named.
        assert procs[0].poll() is None
        for i, command in enumerate(commands):
            host = f"host-{i}" if hosts == "a host each" else None
            procs.append(
                _start(
                    "worker", *command.split(), "--headless",
                    err=tmp_path / f"w{i}.err", host=host,
                )
            )  # fmt: skip
        code = await asyncio.to_thread(procs[0].wait, 120)
        assert code == 0, err.read_text()
        assert "40/40 requests ok" in err.read_text()
        lines = out.read_text().splitlines()
        assert len(lines) == 40 and all(re.fullmatch(r"\d+: \{.*\}", ln) for ln in lines)
        # The master's shutdown reaches the workers it did not start: each exits, cleanly.
        for p in procs[1:]:
            assert await asyncio.to_thread(p.wait, 30) == 0, p.args
    finally:
        kill_all(procs)


async def test_a_run_whose_external_workers_never_come_names_them_and_exits_3(
    tmp_path: Path,
) -> None:
    """Every missing replica is named in one error line; meanwhile, where no status line
    shows, a line now and then says whom it waits for."""
    config = tmp_path / "p.yaml"
    config.write_text(DEMO.read_text().replace("chunk_timeout: 30s", "startup_timeout: 2s"))
    err = tmp_path / "run.err"
    proc = _start("run", str(config), "--external-workers", "--input", '{"value": "a b"}',
                  "--progress-every", "0.5", err=err)  # fmt: skip
    try:
        assert await asyncio.to_thread(proc.wait, 60) == 3
        text = err.read_text()
        errors = [ln for ln in text.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1, text
        for name in ("join[0]", "split[0]", "upper[0]"):
            assert name in errors[0], errors
        # With stderr not a terminal no status line shows: lines say whom it waits for.
        assert "waiting for 3 of 3 workers: " in text, text
    finally:
        kill_all([proc])


async def test_a_master_bound_to_every_interface_serves_workers_wherever_they_reach_it(
    tmp_path: Path,
) -> None:
    """``stagewire master CONFIG --bind tcp://0.0.0.0:PORT``, as the design shows it, was
    refused: its data endpoint names the wildcard, no address to connect to. Now each worker
    sends the client's data to the host it reached the master at (loopback here; each as
    if on a host of its own, so over TCP), and the commands printed name this host."""
    port = free_port()
    err = tmp_path / "master.err"
    procs = [_start("master", str(DEMO), "--bind", f"tcp://0.0.0.0:{port}", err=err)]
    try:
        text = await workers_announced(err)
        assert f"stagewire worker --master tcp://{socket.gethostname()}:{port} " in text, text
        master = f"tcp://127.0.0.1:{port}"
        for stage in ("split", "upper", "join"):
            procs.append(
                _start("worker", "--master", master, "--stage", stage, "--headless",
                       err=tmp_path / f"{stage}.err", host=f"host-{stage}")
            )  # fmt: skip
        await wait_for(lambda: "serving " in err.read_text(errors="replace"), 60)
        done = _submit(master, '{"value": "wild card"}')
        assert done.returncode == 0 and "WILD CARD" in done.stdout, (done.stdout, done.stderr)
    finally:
        kill_all(procs)


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "*"])
def test_a_worker_refuses_a_wildcard_bind_host(tmp_path: Path, wildcard: str) -> None:
    """Peers are told the address a worker binds: a wildcard would name no host."""
    err = tmp_path / "worker.err"
    proc = _start("worker", "--master", "tcp://127.0.0.1:9", "--stage", "upper",
                  "--bind-host", wildcard, err=err)  # fmt: skip
    assert proc.wait(60) == 2
    assert "binds every interface" in err.read_text()


@pytest.mark.parametrize("timeout", ["nan", "0", "-1"])
def test_a_worker_refuses_a_connect_timeout_that_is_no_time(tmp_path: Path, timeout: str) -> None:
    """A NaN deadline is never reached: the worker waited for ever, saying nothing."""
    err = tmp_path / "worker.err"
    proc = _start("worker", "--master", f"tcp://127.0.0.1:{free_port()}", "--stage", "upper",
                  "--connect-timeout", timeout, err=err)  # fmt: skip
    assert proc.wait(60) == 2
    assert "--connect-timeout must be a positive number of seconds" in err.read_text()


def test_a_worker_waiting_for_its_master_says_so_then_gives_up(tmp_path: Path) -> None:
    """A worker started by hand whose master does not answer says what it waits for (on
    the default log level), then exits 4 at its --connect-timeout."""
    err = tmp_path / "worker.err"
    master = f"tcp://127.0.0.1:{free_port()}"
    proc = _start("worker", "--master", master, "--stage", "upper", "--connect-timeout", "4",
                  "--headless", err=err)  # fmt: skip
    assert proc.wait(60) == 4
    lines = err.read_text().splitlines()
    waiting = [ln for ln in lines if "waiting_for_master" in ln]
    assert waiting and master in waiting[0] and '"gives_up_in_s"' in waiting[0], lines
    assert "master_unreachable" in lines[-1], lines


def test_a_worker_binds_its_address_toward_the_master() -> None:
    """The kernel's route decides: loopback toward loopback (v4 or v6) and ipc://. (Other
    hosts' addresses: ``test_netns.py``.)"""
    assert address_toward("tcp://127.0.0.1:7600") == "127.0.0.1"
    assert address_toward("tcp://localhost:7600") in ("127.0.0.1", "::1")
    assert address_toward("ipc:///tmp/stagewire-master") == "127.0.0.1"
    if socket.has_ipv6:
        with contextlib.suppress(OSError):  # a kernel without IPv6 on loopback
            assert address_toward("tcp://[::1]:7600") == "::1"
    assert tcp_endpoint("::1", 0) == "tcp://[::1]:0" and tcp_endpoint("10.0.0.6", 5) == (
        "tcp://10.0.0.6:5"
    )


async def test_workers_started_before_the_master_wait_for_it(tmp_path: Path) -> None:
    """Any order: workers started first retry until the master listens at the agreed
    address."""
    port = free_port()
    master = f"tcp://127.0.0.1:{port}"
    procs = [
        _start("worker", "--master", master, "--stage", stage, "--headless",
               err=tmp_path / f"{stage}.err")
        for stage in ("split", "upper", "join")
    ]  # fmt: skip
    try:

        async def all_running() -> bool:
            return all(alive(p.pid) for p in procs)

        await wait_for(all_running, timeout=10)
        err = tmp_path / "run.err"
        procs.append(
            _start("run", str(DEMO), "--external-workers", "--bind", master,
                   "--input-file", str(INPUTS), "--requests", "10", err=err)
        )  # fmt: skip
        assert await asyncio.to_thread(procs[-1].wait, 120) == 0, err.read_text()
        assert "10/10 requests ok" in err.read_text()
        for p in procs[:3]:
            assert await asyncio.to_thread(p.wait, 30) == 0
    finally:
        kill_all(procs)


async def test_external_workers_on_two_hosts_refuse_an_edge_pinned_to_shm(tmp_path: Path) -> None:
    """Host identity reaches the master from workers it did not start: an shm edge between
    two hosts fails start-up with exit code 3 and one line naming the edge."""
    config = tmp_path / "p.yaml"
    config.write_text(
        DEMO.read_text().replace("{from: split, to: upper}", "{from: split, to: upper, "
                                 "transport: shm}")
    )  # fmt: skip
    err = tmp_path / "run.err"
    procs = [
        _start("run", str(config), "--external-workers", "--input", '{"value": "a b"}', err=err)
    ]
    try:
        await workers_announced(err)
        found = re.findall(r"stagewire worker (--master \S+ --stage (\S+) --replica \d+)",
                           err.read_text())  # fmt: skip
        workers = {}
        for command, stage in found:
            workers[stage] = _start(
                "worker", *command.split(), "--headless", "--connect-timeout", "20",
                err=tmp_path / f"{stage}.err", host=f"host-{stage}",
            )  # fmt: skip
            procs.append(workers[stage])
        assert await asyncio.to_thread(procs[0].wait, 60) == 3
        errors = [ln for ln in err.read_text().splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and "'split->upper' is pinned to transport 'shm'" in errors[0], (
            err.read_text()
        )
        # The refused worker is told why and exits at once, well before its 20 s
        # --connect-timeout would end it (the others, unrefused, are killed below).
        await wait_for(lambda: any(p.poll() == 3 for p in workers.values()), timeout=15)
        refused = [stage for stage, p in workers.items() if p.poll() == 3]
        logs = "".join((tmp_path / f"{stage}.err").read_text() for stage in refused)
        assert "refused_by_master" in logs and "pinned to transport 'shm'" in logs, logs
    finally:
        kill_all(procs)


async def test_a_worker_for_a_stage_the_pipeline_lacks_is_told_and_exits(tmp_path: Path) -> None:
    """A mistyped stage name (or replica beyond ``replicas``) gets an answer naming the
    pipeline's stages, and the worker exits 3 at once instead of retrying for minutes."""
    err = tmp_path / "run.err"
    run = _start("run", str(DEMO), "--external-workers", "--input", '{"value": "a"}', err=err)
    procs = [run]
    try:
        await workers_announced(err)
        master = re.search(r"--master (\S+)", err.read_text()).group(1)  # type: ignore[union-attr]
        for stage, replica in (("uper", "0"), ("upper", "3")):
            wlog = tmp_path / f"{stage}-{replica}.err"
            worker = _start("worker", "--master", master, "--stage", stage, "--replica", replica,
                            "--headless", "--connect-timeout", "60", err=wlog)  # fmt: skip
            procs.append(worker)
            assert await asyncio.to_thread(worker.wait, 20) == 3
            text = wlog.read_text()
            assert "refused_by_master" in text and "split, upper, join" in text, text
    finally:
        kill_all(procs)


async def test_a_second_worker_for_a_live_replica_is_refused_and_one_gone_quiet_is_replaced(
    tmp_path: Path,
) -> None:
    """A worker started for a slot whose replica is alive (heard from within two heartbeats)
    is refused, naming the holder, and exits 3; the holder serves on. Once the holder has
    gone quiet (stopped here), a new worker takes its slot, and the old one, when it runs
    again, is told so and exits saying why (code 5)."""
    config = tmp_path / "echo.yaml"
    config.write_text(
        "name: echo\n"
        "defaults: {heartbeat_interval: 100ms, heartbeat_timeout: 30s}\n"
        "stages:\n"
        '  echo: {impl: "tests.pipeline.sample_stages:Echo"}\n'
    )
    master, procs = await _serving(config, tmp_path)
    holder = procs[1]
    try:
        second = _start("worker", "--master", master, "--stage", "echo", "--headless",
                        "--connect-timeout", "60", err=tmp_path / "second.err")  # fmt: skip
        procs.append(second)
        assert await asyncio.to_thread(second.wait, 60) == 3
        text = (tmp_path / "second.err").read_text()
        assert "refused_by_master" in text and f"by pid {holder.pid}" in text, text
        assert _submit(master, '{"value": "still"}').stdout.split() == ['{"value":"still"}']
        # Stopped, the holder's heartbeats stop: by the time a new worker has started and
        # registers (its interpreter's start alone outlasts two 100 ms beats), it has gone
        # quiet, and the new one takes the slot.
        os.kill(holder.pid, signal.SIGSTOP)
        third = _start("worker", "--master", master, "--stage", "echo", "--headless",
                       "--connect-timeout", "60", err=tmp_path / "third.err")  # fmt: skip
        procs.append(third)
        master_log = tmp_path / "master.err"
        await wait_for(lambda: f"new registration (pid {third.pid}" in master_log.read_text(), 60)
        assert _submit(master, '{"value": "new"}').stdout.split() == ['{"value":"new"}']
        os.kill(holder.pid, signal.SIGCONT)
        assert await asyncio.to_thread(holder.wait, 30) == EXIT_REPLACED
        text = (tmp_path / "echo.err").read_text()
        assert "stopped_by_master" in text and f"(pid {third.pid} on host" in text, text
        assert third.poll() is None
    finally:
        kill_all(procs)


async def test_a_worker_declared_dead_and_replaced_meanwhile_is_told_when_it_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker stopped past its heartbeat timeout (declared dead), whose slot a new worker
    took meanwhile, is told so once it runs again: it registers again, hears which worker
    holds its slot, and exits saying so. The master dropped its heartbeats without a word
    (they came from an identity other than the slot's), and it exited 4 two timeouts
    later, claiming its master lost."""
    config = tmp_path / "echo.yaml"
    config.write_text(
        "name: echo\n"
        "defaults: {heartbeat_interval: 100ms, heartbeat_timeout: 1s}\n"
        "stages:\n"
        '  echo: {impl: "tests.pipeline.sample_stages:Echo"}\n'
    )
    monkeypatch.setenv("STAGEWIRE_LOG_LEVEL", "info")  # the master logs each replica ready
    master, procs = await _serving(config, tmp_path)
    holder, master_log = procs[1], tmp_path / "master.err"
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        await wait_for(lambda: "replica_dead" in master_log.read_text(), 30)
        third = _start("worker", "--master", master, "--stage", "echo", "--headless",
                       "--connect-timeout", "60", err=tmp_path / "third.err")  # fmt: skip
        procs.append(third)
        await wait_for(functools.partial(_logged, master_log, "replica_ready", 2), 60)
        os.kill(holder.pid, signal.SIGCONT)
        assert await asyncio.to_thread(holder.wait, 30) == 4
        text = (tmp_path / "echo.err").read_text()
        assert "dropped_by_master" in text and "gave its slot to another worker" in text, text
        assert "rejoin_refused" in text and f"by pid {third.pid}" in text, text
        assert "master_lost" not in text, text
        assert "unknown_worker_told" in master_log.read_text()
        assert _submit(master, '{"value": "new"}').stdout.split() == ['{"value":"new"}']
        assert third.poll() is None
    finally:
        kill_all(procs)


@pytest.mark.parametrize("host", ["the master's", "another"])
async def test_a_worker_restarted_at_once_after_kill_9_takes_its_slot_back(
    tmp_path: Path, host: str
) -> None:
    """A worker killed with ``kill -9`` and started again at once (as a supervisor does)
    was refused as a second worker for a live slot, its predecessor heard from under two
    heartbeats before, and exited 3: nobody served the slot. On the master's host the
    master now sees that the holder's process has exited; from another host the newcomer
    is told when the holder would count as quiet, and registers again then."""
    config = tmp_path / "echo.yaml"
    config.write_text(
        "name: echo\n"
        "defaults: {heartbeat_interval: 1s, heartbeat_timeout: 30s}\n"
        "stages:\n"
        '  echo: {impl: "tests.pipeline.sample_stages:Echo"}\n'
    )
    elsewhere = None if host == "the master's" else "worker-host"
    master, procs = await _serving(config, tmp_path, host=elsewhere)
    holder = procs[1]
    try:
        holder.kill()
        await asyncio.to_thread(holder.wait, 30)
        again = _start("worker", "--master", master, "--stage", "echo", "--headless",
                       err=tmp_path / "again.err", host=elsewhere)  # fmt: skip
        procs.append(again)
        master_log = tmp_path / "master.err"
        await wait_for(lambda: f"new registration (pid {again.pid}" in master_log.read_text(), 60)
        assert _submit(master, '{"value": "back"}').stdout.split() == ['{"value":"back"}']
        assert again.poll() is None, (tmp_path / "again.err").read_text()
    finally:
        kill_all(procs)


async def test_a_worker_waiting_long_for_its_master_keeps_waiting() -> None:
    """A worker resends its registration every second while no master answers; past a
    thousand unsent messages its control socket refused more (``zmq.Again``), which ended
    the worker after about 17 minutes with a false ``--bind-host`` error, whatever its
    ``--connect-timeout``. Such a message is now dropped: the next resend says the same."""
    from pipeline._worker import _Worker

    worker = _Worker(f"tcp://127.0.0.1:{free_port()}", "echo", 0, "127.0.0.1")
    try:
        register = Heartbeat("echo", 0)
        sent = [worker.send_control(register) for _ in range(1500)]
        assert all(sent[:1000]) and not any(sent[1100:]), sent.count(True)
    finally:
        worker.close()


async def test_a_worker_stopping_slowly_with_its_loop_free_is_not_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hand-started worker told to stop (SIGTERM) whose teardown takes a while, awaiting
    with its loop free, was ended by its watchdog twice the heartbeat timeout after the
    signal (exit 143, its teardown cut short, blamed on a handler holding the loop). The
    watchdog now ends only a worker whose loop has not run for that long."""
    fifo, mark = tmp_path / "go", tmp_path / "tearing-down"
    os.mkfifo(fifo)
    monkeypatch.setenv("LINGER_FIFO", str(fifo))
    monkeypatch.setenv("HOLD_MARK", str(mark))
    config = tmp_path / "slow.yaml"
    config.write_text(
        "name: slow\n"
        "defaults: {heartbeat_interval: 100ms, heartbeat_timeout: 500ms}\n"
        "stages:\n"
        '  echo: {impl: "tests.pipeline.sample_stages:SlowTeardown"}\n'
    )
    master, procs = await _serving(config, tmp_path)
    worker = procs[1]
    try:
        assert _submit(master, '{"value": "a"}').stdout.split() == ['{"value":"a"}']
        worker.send_signal(signal.SIGTERM)
        await wait_for(mark.exists, timeout=30)
        # Past the 1 s grace (a stop may take 6 s in all), it is still tearing down.
        with pytest.raises(subprocess.TimeoutExpired):
            await asyncio.to_thread(worker.wait, 1.5)
        with fifo.open("w") as f:
            f.write("go\n")
        assert await asyncio.to_thread(worker.wait, 30) == 0
        assert "stop_overdue" not in (tmp_path / "echo.err").read_text()
    finally:
        kill_all(procs)


async def test_a_worker_told_to_stop_while_a_thread_of_its_handler_is_stuck_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped by its master (no signal), a worker whose handler awaited a thread that
    never returns stopped in order, then waited for ever at its exit, which joins the
    loop's executor threads. Its watchdog bounds the exit too."""
    mark = tmp_path / "waiting"
    monkeypatch.setenv("HOLD_MARK", str(mark))
    config = tmp_path / "stuck.yaml"
    config.write_text(
        "name: stuck\n"
        "defaults: {heartbeat_interval: 100ms, heartbeat_timeout: 500ms}\n"
        "stages:\n"
        '  stuck: {impl: "tests.pipeline.sample_stages:AwaitsAStuckThread"}\n'
    )
    master, procs = await _serving(config, tmp_path)
    worker = procs[1]
    try:
        stalled = _submitting(master, '{"value": "a"}')
        procs.append(stalled)
        await wait_for(mark.exists, timeout=30)
        os.kill(procs[0].pid, signal.SIGTERM)
        assert await asyncio.to_thread(procs[0].wait, 30) == 0
        assert await asyncio.to_thread(worker.wait, 30) == 0
        text = (tmp_path / "stuck.err").read_text()
        assert "its exit waits on a thread that does not end" in text, text
        assert await asyncio.to_thread(stalled.wait, 30) == 3  # told the master stopped
    finally:
        kill_all(procs)
        for proc in procs:
            if proc.stdout is not None:
                proc.stdout.close()


async def test_a_second_worker_is_refused_while_the_first_is_still_setting_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker beats from its registration on, through its setup (a model loading): a
    second worker for its slot is refused then too. (Its first beat used to come after its
    setup, so the newcomer displaced it, and the master's start-up failed.)"""
    config = tmp_path / "slow.yaml"
    config.write_text(
        "name: slow\n"
        "defaults: {heartbeat_interval: 100ms, startup_timeout: 60s}\n"
        "stages:\n"
        '  echo: {impl: "tests.pipeline.sample_stages:HangingSetup"}\n'
    )
    monkeypatch.setenv("STAGEWIRE_LOG_LEVEL", "info")  # the master's log says who registered
    err = tmp_path / "master.err"
    master = f"tcp://127.0.0.1:{free_port()}"
    procs = [_start("master", str(config), "--bind", master, err=err)]
    try:
        await workers_announced(err)
        first = _start("worker", "--master", master, "--stage", "echo", "--headless",
                       err=tmp_path / "first.err")  # fmt: skip
        procs.append(first)
        await wait_for(lambda: f'"pid": {first.pid}' in err.read_text(), 60)  # registered
        second = _start("worker", "--master", master, "--stage", "echo", "--headless",
                        err=tmp_path / "second.err")  # fmt: skip
        procs.append(second)
        assert await asyncio.to_thread(second.wait, 60) == 3
        text = (tmp_path / "second.err").read_text()
        assert f"already served, by pid {first.pid}" in text, text
        assert first.poll() is None and procs[0].poll() is None
    finally:
        kill_all(procs)


# ---- stagewire master + stagewire submit ---------------------------------------------------


def _logged(log: Path, event: str, times: int) -> bool:
    """Whether ``log`` names ``event`` ``times`` times."""
    return log.read_text(errors="replace").count(event) == times


def _submit(master: str, value: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", "submit", "--master", master, "--input", value,
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _submitting(master: str, value: str, err: Path | None = None) -> subprocess.Popen[bytes]:
    """A ``stagewire submit`` left running, its outputs readable line by line."""
    with (err or Path(os.devnull)).open("wb") as e:
        return subprocess.Popen(
            [sys.executable, "-m", "pipeline", "submit", "--master", master, "--input", value],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=e,
        )


async def _serving(
    config: Path, tmp_path: Path, *, master_host: str | None = None, host: str | None = None
) -> tuple[str, list[subprocess.Popen[bytes]]]:
    """A ``stagewire master`` on ``config`` and the workers it names, once it serves; as if
    on ``master_host`` and ``host`` (see :func:`_start`) when given."""
    port = free_port()
    master = f"tcp://127.0.0.1:{port}"
    err = tmp_path / "master.err"
    procs = [_start("master", str(config), "--bind", master, err=err, host=master_host)]

    await workers_announced(err)
    found = re.findall(r"stagewire worker (--master \S+ --stage (\S+) --replica \d+)",
                       err.read_text())  # fmt: skip
    for command, stage in found:
        procs.append(
            _start(
                "worker", *command.split(), "--headless", err=tmp_path / f"{stage}.err",
                host=host,
            )
        )  # fmt: skip

    async def serving() -> bool:
        return "serving " in err.read_text(errors="replace")

    await wait_for(serving, timeout=60)
    return master, procs


async def test_submit_to_a_master_streams_each_output_and_the_master_stops_its_workers(
    tmp_path: Path,
) -> None:
    config = tmp_path / "words.yaml"
    config.write_text(
        "name: words\n"
        "stages:\n"
        '  tokens: {impl: "tests.pipeline.sample_stages:Tokens"}\n'
        '  relay: {impl: "tests.pipeline.sample_stages:Relay"}\n'
        "edges:\n"
        "  - {from: tokens, to: relay}\n"
    )
    master, procs = await _serving(config, tmp_path)
    workers = procs[1:]
    try:
        # Several clients at once, each its own process: each gets its own words, in order,
        # one JSON line per streamed chunk.
        texts = [" ".join(f"w{i}x{k}" for k in range(i + 2)) for i in range(4)]
        done = await asyncio.gather(
            *(asyncio.to_thread(_submit, master, f'{{"value": "{t}"}}') for t in texts)
        )
        for text, result in zip(texts, done, strict=True):
            assert result.returncode == 0, result.stderr
            words = [line for line in result.stdout.splitlines() if line]
            expected = [f'[{k},"{w}"]' for k, w in enumerate(text.split())]
            assert words == expected, result.stdout
        # A stage's error fails only that request: exit code 1 and one line naming it.
        boom = _submit(master, '{"value": "a boom"}')
        assert boom.returncode == 1 and "StageError" in boom.stderr, boom.stderr
        assert "relay refused 'boom'" in boom.stderr
        # A bad input: exit code 2 (refused before it is sent: this host has the stages'
        # code, so submit knows the source's type; the master is not bothered).
        bad = _submit(master, '{"value": 7}')
        assert bad.returncode == 2 and "PayloadError" in bad.stderr, bad.stderr
        # A misspelt field is refused as `run` refuses it (it was dropped without a word).
        typo = _submit(master, '{"value": "a", "valeu": "b"}')
        assert typo.returncode == 2, typo.stderr
        assert "--input: Text has no field 'valeu' (its fields: value)" in typo.stderr
        # Ctrl-C while the request streams: it is cancelled everywhere, exit 130.
        stalled = _submitting(master, '{"value": "a stall"}')
        procs.append(stalled)
        assert stalled.stdout is not None
        first = await asyncio.to_thread(stalled.stdout.readline)
        assert first.strip() == b'[0,"a"]'
        stalled.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(stalled.wait, 30) == 130
        stalled.stdout.close()
        # SIGTERM (a service manager's stop) the same, but exit 143 saying so (it was 130).
        err = tmp_path / "termed.err"
        termed = _submitting(master, '{"value": "t stall"}', err)
        procs.append(termed)
        assert termed.stdout is not None
        assert (await asyncio.to_thread(termed.stdout.readline)).strip() == b'[0,"t"]'
        termed.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(termed.wait, 30) == 143
        termed.stdout.close()
        assert "terminated: the request was cancelled" in err.read_text()
        # A client killed while its request stalls sends no Cancel: the master finds it
        # gone (an Alive it cannot deliver) and cancels its request within seconds.
        killed = _submitting(master, '{"value": "b stall"}')
        procs.append(killed)
        assert killed.stdout is not None
        assert (await asyncio.to_thread(killed.stdout.readline)).strip() == b'[0,"b"]'
        killed.kill()
        await asyncio.to_thread(killed.wait, 30)
        killed.stdout.close()
        await wait_for(lambda: "client_gone" in (tmp_path / "master.err").read_text(), 20)
        # And the master is still serving.
        assert _submit(master, '{"value": "after"}').stdout.split() == ['[0,"after"]']
        os.kill(procs[0].pid, signal.SIGTERM)
        assert await asyncio.to_thread(procs[0].wait, 60) == 0
        for p in workers:
            assert await asyncio.to_thread(p.wait, 30) == 0
        summary = (tmp_path / "master.err").read_text()
        assert (
            "took 9 requests: 5 completed, 1 failed, 2 cancelled by their clients, 1 whose "
            "clients went away" in summary
        ), summary
    finally:
        kill_all(procs)


async def test_submit_to_a_pipeline_of_several_sinks_names_each_outputs_sink(
    tmp_path: Path,
) -> None:
    """``stagewire submit`` prints each output of a pipeline with several sinks as
    ``{sink: value}``: it printed the bare values, which could not be told apart."""
    config = tmp_path / "two.yaml"
    config.write_text(
        "name: two\n"
        "stages:\n"
        '  a: {impl: "tests.pipeline.sample_stages:Echo"}\n'
        '  b: {impl: "tests.pipeline.sample_stages:Echo"}\n'
        '  c: {impl: "tests.pipeline.sample_stages:Echo"}\n'
        "edges: [{from: a, to: b}, {from: a, to: c}]\n"
    )
    master, procs = await _serving(config, tmp_path)
    try:
        done = _submit(master, '{"value": "x y"}')
        assert done.returncode == 0, done.stderr
        lines = sorted(done.stdout.splitlines())
        assert lines == ['{"b":{"value":"x y"}}', '{"c":{"value":"x y"}}'], done.stdout
    finally:
        kill_all(procs)


async def test_submit_without_a_master_exits_3_and_a_run_refuses_submissions_with_3(
    tmp_path: Path,
) -> None:
    nobody = _submit(f"tcp://127.0.0.1:{free_port()}", '{"value": "a"}', "--timeout", "1")
    assert nobody.returncode == 3, nobody.stderr
    assert "no answer within 1s; check that `stagewire master` runs there" in nobody.stderr
    assert _submit("tcp://127.0.0.1:1", "not json").returncode == 2
    # A batch run's master answers a submission with a clear refusal, not silence.
    err = tmp_path / "run.err"
    run = _start("run", str(DEMO), "--external-workers", "--input", '{"value": "a"}', err=err)
    try:
        await workers_announced(err)
        endpoint = re.search(r"--master (\S+)", err.read_text()).group(1)  # type: ignore[union-attr]
        refused = _submit(endpoint, '{"value": "a"}', "--timeout", "20")
        assert refused.returncode == 3 and "takes no submissions" in refused.stderr
    finally:
        kill_all([run])


async def test_a_client_waiting_when_the_master_stops_is_told(tmp_path: Path) -> None:
    config = tmp_path / "words.yaml"
    config.write_text(
        'name: words\nstages:\n  tokens: {impl: "tests.pipeline.sample_stages:Tokens"}\nedges: []\n'
    )
    master, procs = await _serving(config, tmp_path)
    try:
        err = tmp_path / "submit.err"
        stalled = _submitting(master, '{"value": "a stall"}', err)
        procs.append(stalled)
        assert stalled.stdout is not None
        assert (await asyncio.to_thread(stalled.stdout.readline)).strip() == b'[0,"a"]'
        os.kill(procs[0].pid, signal.SIGTERM)
        # Told at once that the master is unavailable (exit 3), as when it is killed, not
        # after the request's 60 s timeout.
        t0 = time.monotonic()
        code = await asyncio.to_thread(stalled.wait, 30)
        stalled.stdout.close()
        assert code == 3 and time.monotonic() - t0 < 20
        text = err.read_text()
        assert re.search(r"the master stopped while the request was in flight", text), text
        assert await asyncio.to_thread(procs[0].wait, 60) == 0
    finally:
        kill_all(procs)


@pytest.mark.parametrize("master", ["on the workers' host", "on another host"])
async def test_a_worker_killed_9_leaves_no_segment_while_the_rest_serve_on(
    tmp_path: Path, master: str
) -> None:
    """A worker started by hand has no launcher to remove its shm segment when it is killed
    with ``kill -9``: the segment stayed in /dev/shm for as long as the deployment ran. Now
    the processes of its host that outlive it remove it as the master declares it dead (its
    consumers there; the master too, when it shares the host), and the rest serve on."""
    config = tmp_path / "shm.yaml"
    edge = "{from: split, to: upper}"
    demo = (ROOT / "configs" / "demo.yaml").read_text()
    config.write_text(demo.replace(edge, edge[:-1] + ", transport: shm}"))
    master_host = "master-host" if master == "on another host" else "worker-host"
    _, procs = await _serving(config, tmp_path, master_host=master_host, host="worker-host")
    (split,) = [p for p in procs[1:] if "split" in p.args]  # type: ignore[operator]
    try:

        def owned() -> list[str]:
            return [n for n in list_segments() if n.startswith(f"{PREFIX}{split.pid}-")]

        assert owned(), "the shm edge's producer reserves its arena as it starts"
        split.kill()
        await wait_for(lambda: not owned(), 30)
        assert all(p.poll() is None for p in procs if p is not split)
    finally:
        kill_all(procs)


@pytest.mark.parametrize("moment", ["waiting for its master", "serving"])
async def test_ctrl_c_stops_a_worker_started_by_hand_with_one_line(
    tmp_path: Path, moment: str
) -> None:
    """Ctrl-C to a worker started by hand, still waiting for its master or serving one,
    ends it with one line and exit 130 (serving, in order: the master sees it leave). It
    printed a KeyboardInterrupt traceback either way."""
    if moment == "serving":
        config = tmp_path / "echo.yaml"
        config.write_text('stages:\n  echo: {impl: "tests.pipeline.sample_stages:Echo"}\n')
        _, procs = await _serving(config, tmp_path)
        worker, err = procs[1], tmp_path / "echo.err"
    else:
        err = tmp_path / "worker.err"
        worker = _start("worker", "--master", f"tcp://127.0.0.1:{free_port()}", "--stage",
                        "upper", "--headless", err=err)  # fmt: skip
        procs = [worker]
        await wait_for(lambda: "waiting_for_master" in err.read_text(), 30)
    try:
        worker.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(worker.wait, 30) == 130
        text = err.read_text()
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
        if moment == "serving":
            master_log = tmp_path / "master.err"
            await wait_for(lambda: "replica_dead" in master_log.read_text(), 30)
        else:
            assert text.rstrip().endswith("interrupted"), text
    finally:
        kill_all(procs)


@pytest.mark.parametrize(
    "how", ["stopped past its timeout", "stopped past twice its timeout", "master restarted"]
)
async def test_a_worker_its_master_does_not_count_registers_again_its_stage_still_set_up(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker the master declared dead while it could not beat (stopped, here, past the
    heartbeat timeout), or one whose master was restarted at its address since it
    registered, beat on unheard: the master dropped its heartbeats without a word, and the
    worker exited 4 claiming its master lost (while that master answered). Then it exited
    4 at once when told, for whatever supervised it to start it anew, loading its model
    again. Now the master tells it, once, and it registers again as it is: its stage is
    set up once, and the master serves through it. Stopped past twice the timeout (when a
    worker gives a silent master up), it exited 4 the moment it ran again, before it could
    hear the master: the time it was stopped counted as the master's silence."""
    # Long enough for a new master to start before the worker gives the old one up.
    timeout = "10s" if how == "master restarted" else "1s"
    config = tmp_path / "echo.yaml"
    config.write_text(
        "name: echo\n"
        f"defaults: {{heartbeat_interval: 100ms, heartbeat_timeout: {timeout}}}\n"
        "stages:\n"
        '  echo: {impl: "tests.pipeline.sample_stages:Echo"}\n'
    )
    monkeypatch.setenv("STAGEWIRE_LOG_LEVEL", "info")  # the worker logs each setup
    master, procs = await _serving(config, tmp_path)
    worker, master_log, worker_log = procs[1], tmp_path / "master.err", tmp_path / "echo.err"
    try:
        assert _submit(master, '{"value": "before"}').stdout.split() == ['{"value":"before"}']
        if how == "master restarted":
            procs[0].kill()
            procs[0].wait()
            master_log = tmp_path / "master2.err"
            # Its address spelt otherwise (every interface): the same pipeline still. The
            # worker compared the bind too, and exited 4 as if the pipeline had changed.
            anywhere = "tcp://0.0.0.0:" + master.rsplit(":", 1)[1]
            procs.append(_start("master", str(config), "--bind", anywhere, err=master_log))
            why = "does not know it"
        else:
            # Twice: a worker that registered again is told again when dropped again.
            for times in (1, 2) if how == "stopped past its timeout" else (1,):
                os.kill(worker.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                dead = functools.partial(_logged, master_log, "replica_dead", times)
                await wait_for(dead, 30)
                if how == "stopped past twice its timeout":
                    # The freeze itself is what is tested: it must outlast 2 s.
                    await wait_for(lambda at=stopped: time.monotonic() - at > 2.5, 30)
                os.kill(worker.pid, signal.SIGCONT)
                await wait_for(functools.partial(_logged, worker_log, "rejoined", times), 30)
            why = "declared it dead"
        await wait_for(lambda: "rejoined" in worker_log.read_text(), 30)
        await wait_for(lambda: "serving " in master_log.read_text(errors="replace"), 30)
        done = _submit(master, '{"value": "after"}')
        assert done.stdout.split() == ['{"value":"after"}'], (done.stdout, done.stderr)
        text = worker_log.read_text()
        assert "dropped_by_master" in text and why in text, text
        assert text.count("stage_started") == 1, text
        assert "master_lost" not in text and worker.poll() is None, text
        assert "unknown_worker_told" in master_log.read_text()
    finally:
        kill_all(procs)


#: tokens -> hold, where hold's handler holds its loop until a line comes through the FIFO
#: named by LINGER_FIFO; a heartbeat timeout of 0.5 s (a watchdog grace of 1 s).
_HOLD_CONFIG = (
    "name: hold\n"
    "defaults: {heartbeat_interval: 100ms, heartbeat_timeout: 500ms}\n"
    "stages:\n"
    '  tokens: {impl: "tests.pipeline.sample_stages:Tokens"}\n'
    '  hold: {impl: "tests.pipeline.sample_stages:HoldsLoop"}\n'
    "edges:\n  - {from: tokens, to: hold}\n"
)


async def _holding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[Path, str, list[subprocess.Popen[bytes]], subprocess.Popen[bytes]]:
    """A master serving _HOLD_CONFIG with hand-started workers: the FIFO that lets the
    handler go on, the master's endpoint, every process, and the hold stage's worker."""
    fifo = tmp_path / "go"
    os.mkfifo(fifo)
    monkeypatch.setenv("LINGER_FIFO", str(fifo))
    config = tmp_path / "hold.yaml"
    config.write_text(_HOLD_CONFIG)
    master, procs = await _serving(config, tmp_path)
    (holder,) = [p for p in procs[1:] if "--stage hold" in " ".join(map(str, p.args))]
    return fifo, master, procs, holder


async def test_a_hand_started_worker_finishes_a_long_step_after_one_ctrl_c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C at a worker started by hand while its handler holds the loop for longer than
    twice the heartbeat timeout (a long model step): the step finishes, its request is
    answered, and the worker exits 130. (Its watchdog killed it a grace after the signal:
    exit 143, the request failed.) A second Ctrl-C would arm the watchdog."""
    fifo, master, procs, holder = await _holding(tmp_path, monkeypatch)
    try:
        asking = _submitting(master, '{"value": "a b"}')
        procs.append(asking)
        # The handler holds its loop from the moment it opens the FIFO for reading.
        writer = await asyncio.wait_for(asyncio.to_thread(fifo.open, "w"), 30)
        with writer:
            holder.send_signal(signal.SIGINT)
            with pytest.raises(subprocess.TimeoutExpired):  # past the 1 s grace: alive
                await asyncio.to_thread(holder.wait, 2.5)
            writer.write("go\n")
        assert asking.stdout is not None
        assert (await asyncio.to_thread(asking.stdout.readline)).strip() == b'{"value":"a b"}'
        asking.stdout.close()
        assert await asyncio.to_thread(holder.wait, 30) == 130
        assert "stop_overdue" not in (tmp_path / "hold.err").read_text()
    finally:
        kill_all(procs)


async def test_a_hand_started_worker_whose_handler_holds_its_loop_outlives_no_master(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker started by hand whose handler holds its loop for good, its master killed
    -9: its heartbeat thread, which hears the master's beats too, ends it (exit 4) once the
    master and the loop have both been silent twice the heartbeat timeout. (Only its loop
    judged the master, so it ran for ever.)"""
    fifo, master, procs, holder = await _holding(tmp_path, monkeypatch)
    asking = _submitting(master, '{"value": "a b"}')
    procs.append(asking)
    try:
        # The handler holds its loop from the moment it opens the FIFO for reading.
        writer = await asyncio.wait_for(asyncio.to_thread(fifo.open, "w"), 30)
        with writer:
            procs[0].kill()
            assert await asyncio.to_thread(holder.wait, 30) == 4
        text = (tmp_path / "hold.err").read_text()
        assert "master_lost" in text and "a handler holds the event loop" in text, text
    finally:
        kill_all(procs)
        assert asking.stdout is not None
        asking.stdout.close()


async def test_a_worker_whose_restarted_master_serves_another_pipeline_exits_4(
    tmp_path: Path,
) -> None:
    """A worker set up for one pipeline cannot serve another: told by a master restarted
    at its address with another config, it exits 4 saying so, to be started anew."""
    config = tmp_path / "echo.yaml"
    text = (
        "name: echo\n"
        "defaults: {heartbeat_interval: 100ms, heartbeat_timeout: 10s}\n"
        "stages:\n"
        '  echo: {impl: "tests.pipeline.sample_stages:Echo", max_concurrency: %d}\n'
    )
    config.write_text(text % 4)
    master, procs = await _serving(config, tmp_path)
    worker = procs[1]
    try:
        procs[0].kill()
        procs[0].wait()
        config.write_text(text % 8)
        procs.append(_start("master", str(config), "--bind", master, err=tmp_path / "m2.err"))
        assert await asyncio.to_thread(worker.wait, 30) == 4
        log = (tmp_path / "echo.err").read_text()
        assert "pipeline_changed" in log and "start the worker anew" in log, log
    finally:
        kill_all(procs)
