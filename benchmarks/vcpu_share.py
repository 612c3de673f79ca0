"""How this machine's CPUs share a pipeline's work: where a woken process runs, and how
much one CPU's work slows the other's.

Run from the repository root::

    .venv/bin/python benchmarks/vcpu_share.py [--rounds N] [--json OUT]

Needs two CPUs or more; it uses the first two this process may run on.

A. Placement. Each round a sender idles for a while, computes for 3 ms (as a stage computes
   between two chunks), sends 8 bytes over a Unix socket to a child blocked in ``epoll``
   and computes on for 1 ms; the child, woken, handles the message for 0.3 ms (as a stage
   handles a chunk) and notes the CPU it woke on. Reported for several idle times: how
   often the child woke on the sender's CPU, the sender's ``send`` time and the child's
   wake-up latency; the baseline is the same with the two pinned to different CPUs. A
   kernel that places the woken process on the waker's CPU while the other CPU idles (as
   this project's development VM does when the sender is lightly loaded) makes the child
   preempt the sender there: ``send`` returns only after the child's handler ran. That is
   what happens to a stage that sends and goes on working, as preprocess (two
   destinations) and prefill (a KV layer per chunk) do.
B. Sibling load. A block of 256x256 float32 matmuls (one torch thread) on the second CPU,
   with the first CPU idle, then while another process runs the same matmuls on it,
   alternately. Two vCPUs that are hyperthreads of one physical core slow each other
   down: any work beside a pipeline's decode loop (the client taking its chunks, the other
   stages) slows the loop, whereas a monolithic process runs alone.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

_SEND = struct.Struct("<d")
_REPLY = struct.Struct("<di")
_LIBC = ctypes.CDLL(None, use_errno=True)

_MATMUL_CHILD = """
import os, sys, time, torch
torch.set_num_threads(1)
os.sched_setaffinity(0, {int(sys.argv[1])})
a = torch.randn(256, 256)
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    a @ a
"""


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _receiver(sock: socket.socket, cpu: int | None) -> None:
    """The child of probe A: wake, handle for 0.3 ms, report when and where it woke."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    poller = select.epoll()
    poller.register(sock.fileno(), select.EPOLLIN)
    replies = []
    while True:
        poller.poll()
        data = sock.recv(64)
        woke = time.perf_counter()
        if not data or data == b"end":
            break
        where = _LIBC.sched_getcpu()
        _spin(0.0003)
        replies.append(_REPLY.pack(woke - _SEND.unpack(data[: _SEND.size])[0], where))
    # Answered only at the end: a reply per message would make the two processes wake
    # each other, which changes where the kernel places the next wake-up.
    sock.sendall(b"".join(replies))


def placement(rounds: int, idle_s: float, cpus: tuple[int, int] | None) -> dict[str, float]:
    """Probe A with the sender idle ``idle_s`` per round, free or pinned apart (``cpus``)."""
    # Packets, not a byte stream: two messages read at once would get one answer.
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:  # the child: no event loop or threads exist yet in this script
        mine.close()
        try:
            _receiver(theirs, None if cpus is None else cpus[1])
        finally:
            os._exit(0)
    theirs.close()
    before = os.sched_getaffinity(0)
    if cpus is not None:
        os.sched_setaffinity(0, {cpus[0]})
    sends, wakes, heres, same = [], [], [], 0
    try:
        for _ in range(rounds):
            time.sleep(idle_s)
            _spin(0.003)
            here = _LIBC.sched_getcpu()
            t0 = time.perf_counter()
            mine.send(_SEND.pack(t0))
            sends.append(time.perf_counter() - t0)
            _spin(0.001)
            heres.append(here)
        mine.send(b"end")
        mine.settimeout(30.0)
        got = mine.recv(rounds * _REPLY.size)
        for (wake, where), here in zip(_REPLY.iter_unpack(got), heres, strict=True):
            wakes.append(wake)
            same += where == here
    finally:
        os.sched_setaffinity(0, before)
        mine.close()
        os.waitpid(pid, 0)
    return {
        "sender_idle_ms": idle_s * 1e3,
        "same_cpu_share": same / rounds,
        "send_us": statistics.median(sends) * 1e6,
        "wake_us": statistics.median(wakes) * 1e6,
    }


def sibling(rounds: int, cpus: tuple[int, int]) -> dict[str, float]:
    """Probe B: matmul block time on ``cpus[1]``, alone and beside the same on ``cpus[0]``."""
    import torch

    torch.set_num_threads(1)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpus[1]})
    a = torch.randn(256, 256)

    def block() -> float:
        t0 = time.perf_counter()
        for _ in range(50):
            a @ a
        return time.perf_counter() - t0

    alone, beside = [], []
    try:
        block()
        for _ in range(rounds):
            alone.append(min(block() for _ in range(3)))
            load = subprocess.Popen(
                [sys.executable, "-c", _MATMUL_CHILD, str(cpus[0]), "1.0"],
            )
            try:
                time.sleep(0.4)  # the child imports torch and starts
                beside.append(min(block() for _ in range(3)))
            finally:
                load.wait(timeout=30)
    finally:
        os.sched_setaffinity(0, before)
    a_ms, b_ms = statistics.median(alone) * 1e3, statistics.median(beside) * 1e3
    return {"alone_ms": a_ms, "beside_ms": b_ms, "ratio": b_ms / a_ms}


IDLE_S = (0.0, 0.001, 0.002, 0.003, 0.005)
#: The idle time of the pinned-apart baseline (seconds).
BASELINE_IDLE_S = 0.003


def render(r: dict[str, Any]) -> str:
    apart, sib = r["pinned_apart"], r["sibling"]
    lines = [
        "| sender idle per round | receiver woke on the sender's CPU | sender's send p50 "
        "| vs pinned apart | receiver's wake-up p50 |",
        "|---|---|---|---|---|",
    ]
    for row in [*r["free"], apart]:
        label = f"{row['sender_idle_ms']:.0f} ms" + (" (pinned apart)" if row is apart else "")
        lines.append(
            f"| {label} | {row['same_cpu_share']:.0%} | {row['send_us']:.1f} µs "
            f"| {row['send_us'] / apart['send_us']:.1f}x | {row['wake_us']:.1f} µs |"
        )
    lines += [
        "",
        "| matmul block on one CPU | the other CPU idle | the other CPU doing the same "
        "| slowdown |",
        "|---|---|---|---|",
        f"| 50 x (256x256 @ 256x256) | {sib['alone_ms']:.2f} ms | {sib['beside_ms']:.2f} ms "
        f"| {sib['ratio']:.2f}x |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100, help="messages per placement probe")
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        print("vcpu_share needs two CPUs; this process may use one", file=sys.stderr)
        return 2
    cpus = (allowed[0], allowed[1])
    result = {
        "cpus": list(cpus),
        "free": [placement(args.rounds, idle, None) for idle in IDLE_S],
        "pinned_apart": placement(args.rounds, BASELINE_IDLE_S, cpus),
        "sibling": sibling(max(2, args.rounds // 20), cpus),
    }
    print(render(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
