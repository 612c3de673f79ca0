"""Starting local worker processes, watching them, and making sure none outlives us.

Workers are fresh interpreters (the spawn start method) running the same entry point as
``stagewire worker``. Each gets the read end of a pipe whose write end only this process
holds, and SIGTERMs itself at its end of file, so even a ``kill -9`` of the master leaves no
worker behind. Shutdown asks
politely first (the master's ``Shutdown``), then SIGTERM, then SIGKILL, and only ever
signals pids this launcher started.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import select
import signal
import sys
import time
import weakref
from collections.abc import Callable

import structlog

from pipeline._config import PipelineSpec
from pipeline._errors import PipelineError
from pipeline._exit_codes import EXIT_REPLACED
from pipeline._leftovers import remove_leftovers_of
from pipeline._lifecycle import interrupts_deferred
from pipeline._security import KEYS_ENV, CurveKeys
from transports._liveness import pid_alive

__all__ = ("LocalLauncher",)

log = structlog.get_logger("stagewire.launcher")

#: A worker that served this long (since its master counted it ready) before it exited had
#: recovered: its restart budget (and backoff) start afresh, so crashes days apart never
#: use it up. Time spent in setup does not count: a restart whose setup hangs until the
#: master kills it, or fails late, never recovered.
STABLE_S = 60.0

#: A restart waits this long before its first attempt, twice as long before each next one,
#: and never longer than :data:`RESTART_BACKOFF_MAX_S` (seconds); a close cuts it short.
RESTART_BACKOFF_S = 0.25
RESTART_BACKOFF_MAX_S = 5.0


class LocalLauncher:
    """Starts one process per replica on this host and reports their exits."""

    def __init__(
        self,
        spec: PipelineSpec,
        master: str,
        on_exit: Callable[[str, int, int, int], None],
        *,
        max_restarts: int = 3,
        stable_s: float = STABLE_S,
        on_given_up: Callable[[str, int], None] | None = None,
        held_by_another: Callable[[str, int, int], bool] | None = None,
        keys: CurveKeys | None = None,
        worker_stdout: int | None = None,
    ) -> None:
        self._spec = spec
        #: The descriptor the workers' stdout goes to (None: this process's stdout).
        self._worker_stdout = worker_stdout
        #: The pipeline's CURVE pair, which every worker started here is given.
        self._keys = keys
        self._master = master
        self._on_exit = on_exit
        #: Told when a replica that exited will not be restarted.
        self._on_given_up = on_given_up
        #: Asked, of a worker that exited saying it was replaced (code 5), whether its
        #: slot has another live holder: the code alone could be a stage's own exit(5).
        self._held_by_another = held_by_another
        self.procs: dict[tuple[str, int], asyncio.subprocess.Process] = {}
        #: A pidfd of each worker not yet seen to exit, by pid: what ``kill_now`` signals,
        #: which cannot reach another process that reused the pid.
        self._pidfds: dict[int, int] = {}
        #: Every pid this launcher started, restarts included: their shared memory is
        #: removed when they exit, however they exit.
        self.started: set[int] = set()
        self._watchers: list[asyncio.Task[None]] = []
        self._closing = False
        #: Set as ``aclose`` begins: a restart's backoff ends at once.
        self._closed = asyncio.Event()
        #: The pipe each worker watches for this process's end (see _lifeline).
        self._life: tuple[int, int] | None = None
        _LAUNCHERS.add(self)
        self._max_restarts = max_restarts
        self._stable_s = stable_s
        #: Restarts since each slot's worker last served for ``stable_s`` (the budget used).
        self.restarts: dict[tuple[str, int], int] = {}
        #: When each running worker became ready (its master says so), by pid.
        self._ready_at: dict[int, float] = {}
        #: Restart crashed workers; set once the pipeline is up (before that, a worker
        #: that exits is a start-up failure to report, not to retry).
        self.supervise = False

    def _env(self, stage: str) -> dict[str, str]:
        env = dict(os.environ)
        # Workers import stage classes by path, so they see the modules the parent sees.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        paths.insert(0, os.getcwd())
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
        extra = dict(self._spec.stages[stage].env)
        given = extra.pop("PYTHONPATH", None)
        if given:
            # Added in front, not put in place of what lets the worker import its stage.
            env["PYTHONPATH"] = os.pathsep.join((given, env["PYTHONPATH"]))
        env.update(extra)
        # The master's pair or none: a stray STAGEWIRE_KEYS must not make a worker refuse
        # (or be refused by) a master that runs without one.
        if self._keys is not None:
            env[KEYS_ENV] = os.fspath(self._keys.directory)
        else:
            env.pop(KEYS_ENV, None)
        return env

    def _lifeline(self) -> int:
        """The read end of a pipe whose write end only this process holds: each worker
        gets it and watches it, and its end of file says this process is gone, however it
        ended. (The kernel's parent-death signal, which it stands in for, comes when the
        *thread* that started the worker ends: a pipeline started from a worker thread of
        a service lost its workers when that thread did.)"""
        if self._life is None:
            self._life = os.pipe()  # neither end inherited but where passed
        return self._life[0]

    def _close_lifeline(self) -> None:
        life, self._life = self._life, None
        if life is not None:
            for fd in life:
                with contextlib.suppress(OSError):
                    os.close(fd)

    async def start_all(self) -> None:
        """Start every replica of every stage.

        Raises:
            OSError: a process could not be started.
        """
        from transports.shm import sweep_dead_owners

        # Segments of processes that died without cleaning up (a crash, a kill -9 of a
        # whole pipeline) would otherwise hold /dev/shm until reboot.
        swept = sweep_dead_owners()
        if swept:
            log.info("shm_segments_swept", count=len(swept))
        for stage, sspec in self._spec.stages.items():
            for k in range(sspec.replicas):
                if self._closing:
                    return  # closed while starting: the rest would only be stopped again
                await self.start(stage, k)

    async def _spawn(self, stage: str, replica: int) -> asyncio.subprocess.Process:
        """The process of one replica, started.

        Raises:
            OSError: it could not be started.
        """
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "pipeline",
            "worker",
            "--master",
            self._master,
            "--stage",
            stage,
            "--replica",
            str(replica),
            "--parent-pid",
            str(os.getpid()),
            "--parent-fd",
            str(self._lifeline()),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._worker_stdout,
            pass_fds=(self._lifeline(),),
            env=self._env(stage),
            # Its own session: a Ctrl-C at the terminal reaches only the master, which stops
            # the workers in order (one still importing would print a traceback for it).
            start_new_session=True,
        )

    async def start(self, stage: str, replica: int) -> int:
        """Start one replica's process; returns its pid.

        Raises:
            PipelineError: the process could not be started (out of processes or memory,
                an environment too large), saying which and why.
        """
        try:
            proc = await self._spawn(stage, replica)
        except OSError as exc:
            too_large = " (its environment is too large)" if exc.errno == errno.E2BIG else ""
            raise PipelineError(
                f"cannot start a worker for stage {stage!r} replica {replica}: "
                f"{exc.strerror or exc}{too_large}"
            ) from exc
        self.procs[(stage, replica)] = proc
        self.started.add(proc.pid)
        with contextlib.suppress(OSError, AttributeError):  # gone already, or no pidfds
            self._pidfds[proc.pid] = os.pidfd_open(proc.pid)
        if self._closing:
            # The close began while this one was spawned, and may have signalled the others
            # already: this one is stopped at once.
            proc.kill()
        self._watchers.append(
            asyncio.get_running_loop().create_task(self._watch(stage, replica, proc))
        )
        return proc.pid

    def became_ready(self, stage: str, replica: int, pid: int) -> None:
        """The master counts the replica ready: it serves from now on, if ``pid`` is the
        slot's process (stability is timed from here, see :data:`STABLE_S`)."""
        proc = self.procs.get((stage, replica))
        if proc is not None and proc.pid == pid and proc.returncode is None:
            self._ready_at[pid] = asyncio.get_running_loop().time()

    async def _watch(self, stage: str, replica: int, proc: asyncio.subprocess.Process) -> None:
        loop = asyncio.get_running_loop()
        code = await proc.wait()
        ready_at = self._ready_at.pop(proc.pid, None)
        self._forget_pidfd(proc.pid)
        if self._closing:
            return
        # A worker that exited, even by kill -9, owns no more shared memory; readers that
        # still map a segment keep their mapping until they drop it.
        remove_leftovers_of([proc.pid])
        log.warning("worker_exited", stage=stage, replica=replica, pid=proc.pid, code=code)
        self._on_exit(stage, replica, code, proc.pid)
        key = (stage, replica)
        if ready_at is not None and loop.time() - ready_at >= self._stable_s:
            self.restarts[key] = 0
        # A worker that crashed, was killed, or failed its setup once the pipeline was up
        # (a transient error, as memory its predecessor still held) is restarted, with
        # backoff, a bounded number of times in a row, and takes its slot back. So is one
        # that ended with 0 (its code, or a library in it, called exit): outside a close
        # no worker is told to. One the master replaced (code 5, and another worker holds
        # its slot, which the master confirms) has a successor there; one
        # that failed at start-up fails the start. A restart that cannot even be spawned
        # (out of processes, memory or descriptors) uses an attempt of the same budget.
        if (
            code == EXIT_REPLACED
            and self._held_by_another is not None
            and self._held_by_another(stage, replica, proc.pid)
        ):
            return
        while not self.closing():
            done = self.restarts.get(key, 0)
            if not self.supervise or done >= self._max_restarts:
                if self.supervise and self._on_given_up is not None:
                    self._on_given_up(stage, replica)
                return
            self.restarts[key] = done + 1
            # The backoff, cut short by a close: nothing is restarted then.
            backoff = min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2**done)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await self._closed.wait()
            if self.closing():
                return
            log.info("worker_restarting", stage=stage, replica=replica, attempt=done + 1)
            try:
                # Shielded: once spawning starts it completes, so the process is tracked.
                await asyncio.shield(self.start(stage, replica))
            except Exception as exc:  # OSError mostly: out of processes, memory, descriptors
                log.warning(
                    "worker_restart_failed",
                    stage=stage,
                    replica=replica,
                    attempt=done + 1,
                    error=repr(exc),
                )
                continue
            return

    def closing(self) -> bool:
        """Whether the launcher is stopping its workers (nothing is restarted any more)."""
        return self._closing

    def kill_hung(self, stage: str, replica: int, pid: int) -> bool:
        """SIGKILL the replica's process if it is ``pid``, one this launcher started and still
        running: the master declared it dead (it stopped answering), and only its exit
        frees the slot for a restart. True if a signal was sent.

        Raises:
            Nothing: a pid that is not this slot's running process is left alone.
        """
        proc = self.procs.get((stage, replica))
        if proc is None or proc.pid != pid or proc.returncode is not None or self._closing:
            return False
        log.warning("worker_killed_hung", stage=stage, replica=replica, pid=pid)
        proc.kill()
        return True

    @property
    def pids(self) -> dict[tuple[str, int], int]:
        """Pids of the processes still running, by (stage, replica)."""
        return {key: p.pid for key, p in self.procs.items() if p.returncode is None}

    def begin_close(self) -> None:
        """The pipeline is closing: from now on a worker that exits (told to by its master)
        is neither reported nor restarted, and a restart's backoff ends at once."""
        self._closing = True
        self._closed.set()

    async def aclose(self, grace: float = 5.0) -> None:
        """Wait ``grace`` seconds for workers to exit, then terminate, then kill.

        Raises:
            Nothing: only pids this launcher started are signalled.
        """
        self.begin_close()
        while True:
            await self._stop_running(grace)
            await asyncio.gather(*self._watchers, return_exceptions=True)
            # A restart whose spawn was under way when closing began has added a process
            # since: stop it too, without a grace period.
            if not any(p.returncode is None for p in self.procs.values()):
                break
            grace = 0.0
        remove_leftovers_of(self.started)
        self._close_lifeline()

    def _forget_pidfd(self, pid: int) -> None:
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            os.close(fd)

    def kill_now(self, *, loop_closed: bool = False) -> None:
        """SIGKILL every worker still running, without awaiting anything, and remove their
        shared memory once they are gone (up to 2 s): for a close that cannot wait (it was
        cancelled, or its event loop has closed: ``loop_closed``, when nothing else will
        reap them or close their transports).

        Each worker is signalled through its pidfd, which names that process and no other,
        even if its pid was reused (one without a pidfd by its pid, only while it is a child
        not yet reaped).

        Raises:
            KeyboardInterrupt: one that came meanwhile (a second Ctrl-C), held back until
                all of this was done.
        """
        with interrupts_deferred():
            self._kill_now(loop_closed)

    def _kill_now(self, loop_closed: bool) -> None:
        self._closing = True
        victims: dict[int, int] = {}
        for pid, fd in self._pidfds.items():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            victims[fd] = pid
        # Any without a pidfd (none could be opened: the process was out of descriptors).
        unwatched = [
            proc
            for proc in self.procs.values()
            if proc.returncode is None and proc.pid not in self._pidfds and _kill_child(proc.pid)
        ]
        deadline = time.monotonic() + 2.0
        waiting = dict(victims)
        poller = select.poll()
        for fd in waiting:
            poller.register(fd, select.POLLIN)  # readable once the process has exited
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(int(left * 1000) + 1):
                poller.unregister(fd)
                waiting.pop(fd, None)
        for proc in unwatched:
            while not _child_exited(proc.pid, reap=loop_closed) and time.monotonic() < deadline:
                time.sleep(0.001)  # nothing to wait on but the pid
            if _child_exited(proc.pid, reap=loop_closed):
                _mark_killed(proc)
        for proc in self.procs.values():
            pidfd = self._pidfds.get(proc.pid)
            if pidfd is None or pidfd in waiting:
                continue
            if loop_closed:
                with contextlib.suppress(ChildProcessError, OSError):
                    # Exactly this process, if its loop's watcher has not reaped it.
                    os.waitid(os.P_PIDFD, pidfd, os.WEXITED | os.WNOHANG)
            # Its loop may be ending: what would record the exit may never run.
            _mark_killed(proc)
        for fd, pid in victims.items():
            if fd not in waiting or loop_closed:
                self._forget_pidfd(pid)
        remove_leftovers_of(pid for pid in self.started if not pid_alive(pid))
        self._close_lifeline()  # and any worker this missed hears this process is gone

    async def _stop_running(self, grace: float) -> None:
        """Wait ``grace`` seconds for the running workers to exit, then terminate, then kill."""
        for sig, wait in ((None, grace), (signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
            # Read afresh each round: a restart already under way may have added a process.
            running = [p for p in self.procs.values() if p.returncode is None]
            if not running:
                return
            if sig is not None:
                for p in running:
                    if p.returncode is None:
                        p.send_signal(sig)
            try:
                async with asyncio.timeout(wait):
                    await asyncio.gather(*(p.wait() for p in running))
            except TimeoutError:
                continue


def _kill_child(pid: int) -> bool:
    """SIGKILL ``pid`` if it is still a child of this process, running or not yet reaped
    (a worker without a pidfd); True if so. A pid already reaped may name another process
    by now, and is left alone."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True


def _child_exited(pid: int, *, reap: bool) -> bool:
    """Whether the child ``pid`` has exited (reaped already, or ``reap`` it now)."""
    flags = os.WEXITED | os.WNOHANG | (0 if reap else os.WNOWAIT)
    try:
        return os.waitid(os.P_PID, pid, flags) is not None
    except ChildProcessError:
        return True


def _mark_killed(proc: asyncio.subprocess.Process) -> None:
    """Record that ``proc`` was killed (it has exited), for when its event loop may never
    hear of it: neither it nor its transport is then reported as left running, and nothing
    will wait for its pid again (which another process may hold once it is reaped)."""
    transport = getattr(proc, "_transport", None)
    popen = getattr(transport, "_proc", None)
    if popen is not None and popen.returncode is None:
        popen.returncode = -signal.SIGKILL
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()  # polls the Popen, which now has its code: no wait


#: Every launcher of this process: a child forked from it (``os.fork``, a multiprocessing
#: pool) closes their lifelines, or the workers would outlive this process as long as the
#: child lives.
_LAUNCHERS: weakref.WeakSet[LocalLauncher] = weakref.WeakSet()


def _forget_lifelines_in_child() -> None:
    for launcher in list(_LAUNCHERS):
        launcher._close_lifeline()


os.register_at_fork(after_in_child=_forget_lifelines_in_child)
