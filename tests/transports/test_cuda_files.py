"""The files CUDA IPC leaves in /dev/shm are removed: by the launcher once a worker exits,
however it exits, and by a process that used CUDA IPC as it exits.

The CUDA driver and torch name these files after the pid of the process they serve; here
real processes (a worker, a child interpreter) create files of exactly those names, so the
removal is tested without a GPU. On a GPU, the cuda_ipc pipeline tests check the real ones.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline import Pipeline, PipelineSpec
from stages.text import Text
from tests.pipeline.conftest import wait_for
from transports._cuda_files import cuda_files_of, remove_cuda_files_of

ROOT = Path(__file__).resolve().parents[2]


def _child(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter from the repository root; it prints its pid."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _exists(names: list[str]) -> list[str]:
    return [n for n in names if os.path.exists(f"/dev/shm/{n}")]


def test_the_files_of_a_killed_process_are_found_and_removed_and_no_others() -> None:
    done = _child(
        """
        import os, signal
        from tests.transports.edge_stages import make_cuda_files
        make_cuda_files(os.getpid())
        print(os.getpid(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    pid = int(done.stdout.split()[0])
    uid = os.getuid()
    # Names that must be left alone: near misses of the patterns, and a live process's.
    others = [
        f"cuda.shm.{uid}.{pid:x}.1.old",
        f"xcuda.shm.{uid}.{pid:x}.1",
        f"torch_{pid}_x_0",
        f"torch_{pid}0_5_0",
        f"cuda.shm.{uid}.{os.getpid():x}.77",
    ]
    for name in others:
        Path("/dev/shm", name).write_bytes(b"")
    try:
        found = cuda_files_of([pid])
        assert len(found) == 2, found
        assert {n.split(".")[0].split("_")[0] for n in found} == {"cuda", "torch"}
        assert sorted(remove_cuda_files_of([pid])) == found
        assert _exists(found) == []
        assert cuda_files_of([pid]) == []
        assert _exists(others) == others
    finally:
        remove_cuda_files_of([pid])
        for name in others:
            Path("/dev/shm", name).unlink(missing_ok=True)


def test_the_files_of_a_process_now_holding_a_reused_pid_are_left_alone() -> None:
    """A pid is reused once its process has been reaped. A caller that names an exited
    worker's pid must not remove files of a live process that holds that pid since and
    made them after it started (here: a live child, named as if it had exited)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        names = [f"cuda.shm.{os.getuid()}.{child.pid:x}.1", f"torch_{child.pid}_1_0"]
        for name in names:
            Path("/dev/shm", name).write_bytes(b"")
        try:
            assert sorted(cuda_files_of([child.pid])) == sorted(names)
            assert remove_cuda_files_of([child.pid]) == []
            assert _exists(names) == names
        finally:
            for name in names:
                Path("/dev/shm", name).unlink(missing_ok=True)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)


@pytest.mark.parametrize("used", [True, False])
def test_a_process_that_used_cuda_ipc_removes_its_driver_file_as_it_exits(used: bool) -> None:
    """Only the driver's file: torch removes its own at a clean exit (here nobody does)."""
    done = _child(
        f"""
        import os
        from tests.transports.edge_stages import make_cuda_files
        from transports._cuda_files import note_cuda_ipc_used
        make_cuda_files(os.getpid())
        if {used}:
            note_cuda_ipc_used()
        print(os.getpid(), flush=True)
        """
    )
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    try:
        left = cuda_files_of([pid])
        kinds = sorted(n.split("_")[0].split(".")[0] for n in left)
        assert kinds == (["torch"] if used else ["cuda", "torch"])
    finally:
        remove_cuda_files_of([pid])


async def test_the_launcher_removes_a_killed_workers_cuda_files() -> None:
    """A worker killed -9 leaves its CUDA IPC files; the launcher removes them once it sees
    the exit, and a restarted worker's files go when the pipeline closes."""
    spec = PipelineSpec.from_dict(
        {
            "name": "cuda-files",
            "stages": {"leaver": {"impl": "tests.transports.edge_stages:LeavesCudaFiles"}},
        }
    )
    async with Pipeline(spec) as pipe:
        assert await pipe.submit(Text("hi")) == Text("hi")
        first = pipe.worker_pids[("leaver", 0)]
        assert len(cuda_files_of([first])) == 2
        os.kill(first, signal.SIGKILL)

        async def removed() -> bool:
            return cuda_files_of([first]) == []

        await wait_for(removed, timeout=20)

        async def restarted() -> bool:
            pid = pipe.worker_pids.get(("leaver", 0))
            return pid not in (None, first) and len(cuda_files_of([pid])) == 2

        await wait_for(restarted, timeout=30)
        second = pipe.worker_pids[("leaver", 0)]
        assert await asyncio.wait_for(pipe.submit(Text("again")), 30) == Text("again")
    assert cuda_files_of([first, second]) == []
