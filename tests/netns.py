"""Hosts for tests: network namespaces joined by one bridge, made and removed by a test.

Each host is a namespace with its own loopback and one interface (``eth0``, ``10.251.0.N``)
on a bridge that lives in a namespace of its own. Nothing touches the machine's own network
namespace, so no packet of a test leaves these namespaces. A process started on a host runs
under ``ip netns exec`` (which execs it: its pid is the process's own) with a host identity
of its own, as on another machine: no shm and no same-host links across hosts. Abstract Unix
sockets are per namespace too, so a same-host link could not cross them anyway.

Needs root and iproute2; ``hosts_or_skip`` skips the test, saying why, where either is
missing or the kernel refuses namespaces.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.procs import ROOT, kill_all

SUBNET = "10.251.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@dataclass
class Host:
    """One namespace: its name, its address on the bridge, and what was started in it."""

    name: str
    address: str
    index: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(
        self,
        *args: str,
        err: Path | None = None,
        out: Path | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        """``python -m pipeline ARGS`` on this host, left running (killed at the end)."""
        environment = dict(os.environ)
        environment["STAGEWIRE_HOST_ID"] = f"netns-host-{self.index}"
        environment.update(env or {})
        with (err or Path(os.devnull)).open("wb") as e, (out or Path(os.devnull)).open("wb") as o:
            proc = subprocess.Popen(
                self.command(sys.executable, "-m", "pipeline", *args),
                stdin=subprocess.DEVNULL,
                stdout=o,
                stderr=e,
                cwd=ROOT,
                start_new_session=True,
                env=environment,
            )
        self.procs.append(proc)
        return proc

    def start_plain(self, *args: str, out: Path, err: Path) -> subprocess.Popen[bytes]:
        """``python -m pipeline ARGS`` on this host in the test's session (a client: a
        SIGINT or SIGTERM ends it as it would a user's)."""
        environment = dict(os.environ, STAGEWIRE_HOST_ID=f"netns-host-{self.index}")
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                self.command(sys.executable, "-m", "pipeline", *args),
                stdin=subprocess.DEVNULL, stdout=o, stderr=e, cwd=ROOT, env=environment,
            )  # fmt: skip
        self.procs.append(proc)
        return proc

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``python -m pipeline ARGS`` on this host, to its end."""
        environment = dict(os.environ, STAGEWIRE_HOST_ID=f"netns-host-{self.index}")
        return subprocess.run(
            self.command(sys.executable, "-m", "pipeline", *args),
            cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=environment,
        )  # fmt: skip

    def command(self, *argv: str) -> list[str]:
        """``argv`` as run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def listening(self) -> list[str]:
        """The addresses of the TCP sockets listening on this host."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.name, "ss", "-ltnH"],
            check=True, capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        return [line.split()[3].rsplit(":", 1)[0] for line in done.stdout.splitlines()]

    def unplug(self) -> None:
        """Take this host off the network: its interface goes down, packets are lost."""
        _ip("-n", self.name, "link", "set", "eth0", "down")

    def plug(self) -> None:
        """Put this host back on the network."""
        _ip("-n", self.name, "link", "set", "eth0", "up")


@contextlib.contextmanager
def hosts_or_skip(count: int) -> Iterator[list[Host]]:
    """``count`` hosts on one bridge; every process started on them is killed, and every
    namespace removed, at the end. Skips the test where namespaces cannot be made."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2's `ip`")
    tag = f"sw{os.getpid()}"
    bridge = f"{tag}br"
    made: list[str] = []
    hosts: list[Host] = []
    try:
        try:
            _ip("netns", "add", bridge)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot make a network namespace here: {exc.stderr.strip()}")
        made.append(bridge)
        _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge, "link", "set", "br0", "up")
        for i in range(count):
            name = f"{tag}h{i}"
            _ip("netns", "add", name)
            made.append(name)
            port = f"p{i}"
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", port,
                "netns", bridge)  # fmt: skip
            _ip("-n", name, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip("-n", bridge, "link", "set", port, "master", "br0")
            _ip("-n", bridge, "link", "set", port, "up")
            hosts.append(Host(name, f"{SUBNET}.{i + 1}", i))
        yield hosts
    finally:
        for host in hosts:
            kill_all(host.procs)
        for name in reversed(made):
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", name)
