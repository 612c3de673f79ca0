"""What a cross-process message costs its sender, by how long the receiver was idle.

Run from the repository root::

    .venv/bin/python benchmarks/wake_cost.py [--rounds N] [--json OUT]

A sender computes (a busy loop) for a gap, then sends 8 bytes over a Unix socket to a child
process blocked in ``epoll``; the child answers with the time it woke. For every gap the
report gives the sender's ``sendmsg`` time and the receiver's wake-up latency (send to
wake), as medians, and both as ratios against the ping-pong with no gap, measured in the
same run.

Why it matters: every hop of a staged pipeline is such a message, and its receiver has
usually been idle (at concurrency 1, a stage sleeps while the others compute). On a VM the
idle vCPU halts, and waking it is paid partly by the sender, inside ``sendmsg``: on the
2-vCPU VM this project is developed on, a send cost 2.6 µs in ping-pong and about 60 µs
after the receiver had been idle 8 ms. A raw ping-pong, the usual wake-up baseline, never
lets the receiver halt, so it understates what a real hop pays.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import struct
import subprocess
import sys
import time

GAPS_S = (0.0, 0.0005, 0.002, 0.008, 0.045)
_STAMP = struct.Struct("<q")


def child(fd: int) -> int:
    """Wait in epoll; on every message answer with the time this process woke."""
    sock = socket.socket(fileno=fd)
    poller = select.epoll()
    poller.register(sock.fileno(), select.EPOLLIN)
    while True:
        poller.poll()
        woke = time.perf_counter_ns()
        if not sock.recv(64):
            return 0
        sock.sendall(_STAMP.pack(woke))


def _spin(seconds: float) -> None:
    """Compute for ``seconds``, as a stage does between two messages."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def measure(rounds: int, gaps: tuple[float, ...] = GAPS_S) -> list[dict[str, float]]:
    """Send cost and wake-up latency for every gap (seconds), in microseconds (medians)."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(theirs.fileno())], pass_fds=[theirs.fileno()]
    )
    theirs.close()
    rows = []
    try:
        for gap in gaps:
            sends, wakes = [], []
            for i in range(rounds + rounds // 5):
                _spin(gap)
                t0 = time.perf_counter_ns()
                mine.sendmsg([b"12345678"])
                t1 = time.perf_counter_ns()
                (woke,) = _STAMP.unpack(mine.recv(_STAMP.size, socket.MSG_WAITALL))
                if i >= rounds // 5:  # the first fifth warms up
                    sends.append((t1 - t0) / 1e3)
                    wakes.append((woke - t0) / 1e3)
            rows.append(
                {
                    "gap_ms": gap * 1e3,
                    "send_us": statistics.median(sends),
                    "wake_us": statistics.median(wakes),
                }
            )
    finally:
        mine.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return rows


def render(rows: list[dict[str, float]]) -> str:
    """The markdown report: medians and ratios against the ping-pong without a gap."""
    base = rows[0]
    lines = [
        "| receiver idle before the send | sendmsg p50 | vs ping-pong "
        "| wake-up p50 | vs ping-pong |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['gap_ms']:g} ms | {r['send_us']:.1f} µs | {r['send_us'] / base['send_us']:.1f}x"
            f" | {r['wake_us']:.1f} µs | {r['wake_us'] / base['wake_us']:.1f}x |"
        )
    lines.append(f"\n- machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="messages per gap (default 200)")
    p.add_argument("--json", metavar="OUT", help="write the raw numbers to this file")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        return child(args.child)
    rows = measure(args.rounds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
