"""A pipeline across hosts: network namespaces joined by a bridge (see ``tests/netns.py``).

The master on one host, its workers on two others, started as the master prints them,
and clients on a fourth: every byte between them crosses an interface other than loopback,
so a process that told its peers a loopback address would be found out.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

from tests.netns import hosts_or_skip
from tests.pipeline.conftest import wait_for, workers_announced

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


def _commands(err: Path) -> dict[str, str]:
    """The ``stagewire worker`` arguments the master printed, by stage."""
    found = re.findall(r"stagewire worker (--master \S+ --stage (\S+) --replica \d+)",
                       err.read_text())  # fmt: skip
    return {stage: command for command, stage in found}


async def test_workers_on_other_hosts_serve_as_printed_without_a_bind_host(
    tmp_path: Path,
) -> None:
    """Workers started as printed (no ``--bind-host``) bind this host's address toward the
    master, so the master, the other host's worker and its network transport reach them.
    With loopback they would tell their peers an address that names the wrong machine."""
    config = tmp_path / "demo.yaml"  # one edge's payloads on the network transport
    config.write_text(
        DEMO.read_text().replace("{from: split, to: upper}", "{from: split, to: upper, "
                                 "transport: network}")
    )  # fmt: skip
    with hosts_or_skip(4) as (master_host, one, two, client):
        err = tmp_path / "master.err"
        endpoint = f"tcp://{master_host.address}:7600"
        master = master_host.start("master", str(config), "--bind", endpoint, err=err)
        await workers_announced(err)
        commands = _commands(err)
        assert sorted(commands) == ["join", "split", "upper"], err.read_text()
        for stage, host in (("split", one), ("upper", two), ("join", one)):
            host.start("worker", *commands[stage].split(), "--headless",
                       err=tmp_path / f"{stage}.err")  # fmt: skip
        await wait_for(lambda: "serving " in err.read_text(), 60)
        for host in (one, two):  # where the workers' ports listen: this host's address
            listening = host.listening()
            assert listening and all(a == host.address for a in listening), listening

        results = await asyncio.gather(
            *(
                asyncio.to_thread(client.run, "submit", "--master", endpoint, "--input",
                                  f'{{"value": "host {i} words"}}')
                for i in range(8)
            )
        )  # fmt: skip
        for i, done in enumerate(results):
            assert done.returncode == 0, done.stderr
            assert done.stdout.strip() == f'{{"value":"HOST {i} WORDS"}}', done.stdout

        master.terminate()
        assert await asyncio.to_thread(master.wait, 60) == 0, err.read_text()
        for host in (one, two):
            for p in host.procs:
                assert await asyncio.to_thread(p.wait, 30) == 0, p.args


async def test_a_master_bound_to_every_interface_is_reached_where_each_worker_found_it(
    tmp_path: Path,
) -> None:
    """A master bound to ``tcp://0.0.0.0:7600`` names the wildcard as its data endpoint:
    each worker on another host sends the client's data to the address it reached the
    master at instead (to the wildcard, it would connect to its own host, and no output
    would ever come)."""
    with hosts_or_skip(3) as (master_host, worker_host, client):
        err = tmp_path / "master.err"
        master_host.start("master", str(DEMO), "--bind", "tcp://0.0.0.0:7600", err=err)
        await workers_announced(err)
        endpoint = f"tcp://{master_host.address}:7600"
        for stage in ("split", "upper", "join"):
            worker_host.start("worker", "--master", endpoint, "--stage", stage, "--headless",
                              err=tmp_path / f"{stage}.err")  # fmt: skip
        await wait_for(lambda: "serving " in err.read_text(), 60)
        done = await asyncio.to_thread(client.run, "submit", "--master", endpoint, "--input",
                                       '{"value": "wild card"}', "--timeout", "20")  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == '{"value":"WILD CARD"}', done.stdout


RELAYS = """\
name: relays
defaults: {heartbeat_interval: 200ms, heartbeat_timeout: 2s, replica_wait: 1s}
stages:
  tokens: {impl: "tests.pipeline.sample_stages:Tokens"}
  relay: {impl: "tests.pipeline.sample_stages:Relay", replicas: 2}
edges:
  - {from: tokens, to: relay}
"""


async def test_a_host_cut_off_fails_its_requests_only_and_its_restarted_worker_rejoins(
    tmp_path: Path,
) -> None:
    """DESIGN's failure rules, with a host taken off the network instead of a process
    killed: the requests bound to the replica there fail with ``StageUnavailable`` within
    the heartbeat timeout while those on the other host's replica go on; the cut-off worker,
    hearing no master, exits on its own (code 4); and once the host is back, the same
    worker command takes the slot back."""
    config = tmp_path / "relays.yaml"
    config.write_text(RELAYS)
    with hosts_or_skip(4) as (master_host, source, cut, other):
        err = tmp_path / "master.err"
        endpoint = f"tcp://{master_host.address}:7600"
        master = master_host.start("master", str(config), "--bind", endpoint, err=err,
                                   env={"STAGEWIRE_LOG_LEVEL": "info"})  # fmt: skip
        await workers_announced(err)
        found = re.findall(r"stagewire worker (--master \S+ --stage (\S+) --replica (\d+))",
                           err.read_text())  # fmt: skip
        commands = {(stage, int(k)): command for command, stage, k in found}
        placement = {("tokens", 0): source, ("relay", 0): cut, ("relay", 1): other}
        workers = {}
        for key, host in placement.items():
            err_file = tmp_path / f"{key[0]}{key[1]}.err"
            workers[key] = host.start("worker", *commands[key].split(), "--headless", err=err_file)
        await wait_for(lambda: "serving " in err.read_text(), 60)

        # Four requests that stall after their first token, two on each relay replica.
        stalled = []
        for i in range(4):
            out = tmp_path / f"stalled{i}.out"
            stalled.append(
                (
                    master_host.start_plain(
                        "submit", "--master", endpoint, "--input",
                        f'{{"value": "s{i} stall"}}', "--timeout", "120",
                        out=out, err=tmp_path / f"stalled{i}.err",
                    ),
                    out,
                )
            )  # fmt: skip
            first = f'[0,"s{i}"]'
            await wait_for(lambda out=out, first=first: first in out.read_text(), 30)  # type: ignore[misc]

        cut.unplug()
        t0 = time.monotonic()
        # Within the heartbeat timeout (2 s, plus the master's check interval), the two on
        # the cut-off replica fail, naming it; the other two still stream.
        await wait_for(lambda: sum(p.poll() is not None for p, _ in stalled) == 2, 10)
        assert time.monotonic() - t0 < 6
        ended = [i for i, (p, _) in enumerate(stalled) if p.poll() is not None]
        for i in ended:
            assert stalled[i][0].returncode == 1
            text = (tmp_path / f"stalled{i}.err").read_text()
            assert "StageUnavailable" in text and "relay" in text, text

        # New requests go to the replica that is left, and complete.
        async def served(words: str) -> None:
            done = await asyncio.to_thread(
                master_host.run, "submit", "--master", endpoint, "--input",
                f'{{"value": "{words}"}}',
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert done.stdout.split() == [f'[{k},"{w}"]' for k, w in enumerate(words.split())]

        for i in range(3):
            await served(f"after cut {i}")
        # The cut-off worker hears no master and exits on its own.
        assert await asyncio.to_thread(workers[("relay", 0)].wait, 30) == 4

        # The host is back: the same command takes the slot back. With the other host's
        # replica killed, only it can serve.
        cut.plug()
        cut.start("worker", *commands[("relay", 0)].split(), "--headless",
                  err=tmp_path / "relay0-again.err")  # fmt: skip
        await wait_for(lambda: err.read_text().count('"replica_ready"') >= 4, 30)
        workers[("relay", 1)].kill()
        await asyncio.to_thread(workers[("relay", 1)].wait, 30)
        await wait_for(lambda: err.read_text().count('"replica_dead"') >= 2, 10)
        for i in range(3):
            await served(f"rejoined {i}")

        for p, _ in stalled:
            if p.poll() is None:
                p.terminate()
        master.terminate()
        assert await asyncio.to_thread(master.wait, 60) == 0, err.read_text()
