"""A pipeline across hosts: network namespaces joined by a bridge (see ``tests/netns.py``).

The master on one host, its workers on two others, started as the master prints them,
and clients on a fourth: every byte between them crosses an interface other than loopback,
so a process that told its peers a loopback address would be found out.
"""

from __future__ import annotations

import asyncio
import re
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
