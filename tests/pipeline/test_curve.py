"""CURVE: ``stagewire keys`` makes a pair; with it every ZeroMQ socket of a pipeline
authenticates and encrypts, and a process without it (or with another pair) is refused.

Real processes and sockets on the loopback address. Encryption is checked on the wire: a
raw TCP connection reads the ZMTP greeting each listening socket sends, which names the
security mechanism it demands (``CURVE`` or ``NULL``).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pipeline import ConfigError, MasterUnavailable, Pipeline
from pipeline._encoded import Encoded
from pipeline._errors import ProducerLost, TransportError
from pipeline._keys import ChunkKey
from pipeline._security import (
    KEYS_ENV,
    load_keys,
    make_keys,
    process_keys,
    refused_count,
    secure_client,
    secure_server,
    set_process_keys,
    stop_guard,
)
from stages.text import Text
from tests.pipeline.conftest import wait_for, workers_announced
from tests.procs import free_port, kill_all, start_stagewire
from transports import EdgeContext
from transports.inline import WIRE_HEADROOM
from transports.network import NetworkTransport

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.yaml"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=env if env is not None else _env(),
    )


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without a key directory, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k != KEYS_ENV}
    env.update(extra)
    return env


def _spawn(
    *args: str, env: dict[str, str] | None = None, err: Path | None = None
) -> subprocess.Popen[bytes]:
    """``python -m pipeline ARGS`` left running, without a key directory unless ``env``
    gives one."""
    return start_stagewire(*args, err=err, env=env if env is not None else _env())


def _keys(directory: Path) -> Path:
    done = _cli("keys", str(directory))
    assert done.returncode == 0, done.stderr
    return directory


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    return _keys(tmp_path / "keys")


@pytest.fixture
def no_process_keys() -> Iterator[None]:
    """Tests here set this process's transport keys; none leak into the next test."""
    before = process_keys()
    try:
        yield
    finally:
        set_process_keys(before)


def _mechanism(endpoint: str) -> bytes:
    """The security mechanism a listening ZeroMQ socket demands, read from its greeting."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        # The start of our own greeting (signature, major version 3): the peer answers with
        # its whole greeting, and we close before a mechanism could be compared.
        s.sendall(b"\xff" + bytes(8) + b"\x7f" + b"\x03")
        greeting = b""
        while len(greeting) < 64:
            more = s.recv(64 - len(greeting))
            assert more, f"{endpoint} closed before its greeting: {greeting!r}"
            greeting += more
    assert greeting[0] == 0xFF and greeting[9] == 0x7F, greeting
    return greeting[12:32].rstrip(b"\0")


def test_keys_makes_a_private_pair_and_refuses_to_overwrite_it(tmp_path: Path) -> None:
    directory = _keys(tmp_path / "k")
    secret = directory / "stagewire.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    first = load_keys(directory)
    assert len(first.public) == 40 and len(first.secret) == 40
    assert "secret" not in repr(first) and first.secret.decode() not in repr(first)

    again = _cli("keys", str(directory))
    assert again.returncode == 2
    assert "already exists; pass --force" in again.stderr
    assert load_keys(directory).public == first.public

    assert _cli("keys", str(directory), "--force").returncode == 0
    assert load_keys(directory).public != first.public


def test_a_bad_key_directory_is_a_one_line_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no CURVE key pair in .*stagewire keys"):
        load_keys(tmp_path / "missing")
    directory = _keys(tmp_path / "k")
    secret = directory / "stagewire.key_secret"
    secret.chmod(0o640)
    with pytest.raises(ConfigError, match="accessible by other users; run 'chmod 600"):
        load_keys(directory)
    secret.chmod(0o600)
    # Others who may write the directory could replace the pair: refused, read or made.
    directory.chmod(0o777)
    with pytest.raises(ConfigError, match="writable by other users"):
        load_keys(directory)
    with pytest.raises(ConfigError, match="writable by other users"):
        make_keys(directory, force=True)
    directory.chmod(0o700)
    load_keys(directory)
    secret.write_text("not a key file\n")
    with pytest.raises(ConfigError, match="not a CURVE key file"):
        load_keys(directory)
    # The command line says so in one line, with the configuration exit code.
    done = _cli("run", str(DEMO), "--input", '{"value": "a"}', "--keys", str(tmp_path / "no"))
    assert done.returncode == 2
    assert done.stderr.count("error:") == 1 and "no CURVE key pair" in done.stderr


async def test_a_pipeline_with_keys_runs_and_its_sockets_demand_curve(keys: Path) -> None:
    """Workers launched by the pipeline get its pair; the master's control and data
    sockets and each worker's data socket greet with CURVE (without keys: NULL)."""
    spec = Pipeline.from_yaml(DEMO).spec
    plain = spec.model_copy(update={"master": spec.master.model_copy(update={"keys": None})})
    secured = spec.model_copy(update={"master": spec.master.model_copy(update={"keys": str(keys)})})
    for s, mechanism in ((secured, b"CURVE"), (plain, b"NULL")):
        async with Pipeline(s) as pipe:
            outs = await asyncio.gather(*(pipe.submit(Text(f"w{i} x")) for i in range(20)))
            assert [o.value for o in outs] == [f"W{i} X" for i in range(20)]
            master = pipe._master_or_fail()
            assert _mechanism(master.endpoint) == mechanism
            assert _mechanism(master.data_endpoint) == mechanism
            for endpoint in pipe.data_endpoints.values():
                assert _mechanism(endpoint) == mechanism


async def test_workers_without_the_pair_are_refused_at_once(keys: Path, tmp_path: Path) -> None:
    """A worker with no keys, or another pair, exits 3 within seconds naming the cause
    (not after its five-minute connect timeout); the master logs the wrong pair."""
    other = _keys(tmp_path / "other")
    spec = Pipeline.from_yaml(DEMO).spec
    secured = spec.model_copy(update={"master": spec.master.model_copy(update={"keys": str(keys)})})
    pipe = Pipeline(secured)
    starting = asyncio.ensure_future(pipe.start(launch=False))
    try:
        await wait_for(lambda: pipe._master is not None and bool(pipe._master.endpoint), 30)
        endpoint = pipe.master_endpoint
        refused_before = refused_count()
        for given, why in ((None, "has no CURVE keys"), (other, f"key pair of {other}")):
            args = ["worker", "--master", endpoint, "--stage", "split", "--headless"]
            if given is not None:
                args += ["--keys", str(given)]
            done = await asyncio.to_thread(_cli, *args)
            assert done.returncode == 3, done.stderr
            assert "refused_by_master" in done.stderr, done.stderr
            assert "refused the connection" in done.stderr and why in done.stderr, done.stderr
            assert "--keys DIR" in done.stderr
        # A peer that learned the public key but not the secret is refused by the
        # master's handler (the others never get that far: their handshakes fail first).
        public, secret = zmq.curve_keypair()
        zctx = zmq.Context()
        spy = zctx.socket(zmq.DEALER)
        spy.setsockopt(zmq.LINGER, 0)
        spy.setsockopt(zmq.CURVE_SERVERKEY, load_keys(keys).public)
        spy.setsockopt(zmq.CURVE_PUBLICKEY, public)
        spy.setsockopt(zmq.CURVE_SECRETKEY, secret)
        spy.connect(endpoint)
        try:
            await wait_for(lambda: refused_count() > refused_before, 10)
        finally:
            spy.close()
            zctx.term()
        # A worker with the pair (from the environment) registers.
        proc = _spawn(
            "worker", "--master", endpoint, "--stage", "split", "--headless",
            env=_env(**{KEYS_ENV: str(keys)}),
        )  # fmt: skip
        try:
            await wait_for(lambda: "split[0]" not in pipe.waiting_for(), 60)
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await pipe.aclose()
            assert await asyncio.to_thread(proc.wait, 30) is not None
    finally:
        if not starting.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
        await pipe.aclose()


async def test_submit_and_connect_need_the_pair(keys: Path, tmp_path: Path) -> None:
    """``stagewire master --keys`` serves ``submit --keys`` and ``Pipeline.connect(keys=)``
    with the same pair; a submit without it, or with another, exits 3 at once naming the
    cause, and a connect fails at once with MasterUnavailable saying so."""
    other = _keys(tmp_path / "other")
    err = tmp_path / "master.err"
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = tmp_path / "p.yaml"  # one edge on the network transport, secured too
    config.write_text(
        DEMO.read_text().replace("{from: split, to: upper}", "{from: split, to: upper, "
                                 "transport: network}")
    )  # fmt: skip
    procs = [_spawn("master", str(config), "--bind", endpoint, "--keys", str(keys), err=err)]
    try:
        await workers_announced(err)
        commands = re.findall(r"stagewire worker (--master .*--keys \S+)", err.read_text())
        assert len(commands) == 3, err.read_text()
        for command in commands:
            procs.append(_spawn("worker", *command.split(), "--headless"))
        await wait_for(lambda: "serving " in err.read_text(), 60)

        ok = await asyncio.to_thread(
            _cli, "submit", "--master", endpoint, "--input", '{"value": "a b"}', "--keys",
            str(keys),
        )  # fmt: skip
        assert ok.returncode == 0 and ok.stdout.strip() == '{"value":"A B"}', ok.stderr
        for extra in ([], ["--keys", str(other)]):
            done = await asyncio.to_thread(
                _cli, "submit", "--master", endpoint, "--input", '{"value": "a"}',
                "--timeout", "60", *extra,
            )  # fmt: skip
            assert done.returncode == 3, done.stderr
            assert "refused the connection" in done.stderr and "--keys DIR" in done.stderr

        async with Pipeline.connect(endpoint, keys=keys) as remote:
            assert (await remote.submit(Text("c d"))) == Text("C D")
        for given in (None, other):
            t0 = time.monotonic()
            with pytest.raises(MasterUnavailable, match="refused the connection"):
                async with Pipeline.connect(endpoint, keys=given, timeout=30):
                    pass
            assert time.monotonic() - t0 < 10
        # Every process ends on its own and cleanly, their keyed contexts included (the
        # split worker's network transport holds one more).
        procs[0].send_signal(signal.SIGTERM)
        for p in procs:
            assert await asyncio.to_thread(p.wait, 60) == 0, p.args
    finally:
        kill_all(procs)


async def test_network_transport_speaks_curve_and_refuses_a_consumer_without_the_pair(
    keys: Path, tmp_path: Path, no_process_keys: None
) -> None:
    """The producer's listening socket demands CURVE once the process has the pair; a
    consumer with it fetches, one without it or with another pair fails with a
    TransportError that names the keys, not a hang. It used to say the producer had exited
    (ProducerLost), which its consumer reported as the producer's stage being gone."""
    set_process_keys(load_keys(keys))
    transport = NetworkTransport(fetch_timeout=2)
    edge = EdgeContext("a->b", "here")
    async with transport.open_sender(edge) as sender:
        desc = await sender.put(ChunkKey("r", "a->b", 0), Encoded(b"h", (b"x" * 1000,)), timeout=5)
        assert _mechanism(desc.endpoint) == b"CURVE"  # type: ignore[attr-defined]
        async with transport.open_receiver(edge) as receiver:
            got = await receiver.get(desc)
            assert bytes(got.header) == b"h" and bytes(got.buffers[0]) == b"x" * 1000
            await receiver.release(desc)
        others = load_keys(_keys(tmp_path / "others"))
        for mine, says in [(None, "one side uses CURVE"), (others, "the keys do not match")]:
            desc = await sender.put(ChunkKey("r", "a->b", 1), Encoded(b"h", (b"y",)), timeout=5)
            set_process_keys(mine)
            async with transport.open_receiver(edge) as receiver:
                with pytest.raises(TransportError, match="--keys DIR") as failed:
                    await asyncio.wait_for(receiver.get(desc), 30)
            assert says in str(failed.value)
            assert not isinstance(failed.value, ProducerLost)


def test_a_server_whose_handler_is_gone_admits_nobody(keys: Path) -> None:
    """The servers demand their ZAP handler: were it stopped (or dead), a peer holding the
    pair is refused, not every peer that knows the public key admitted. A context whose
    handler was never stopped still terminates; one context serves one pair."""
    pair = load_keys(keys)
    ctx = zmq.Context()
    try:
        server = secure_server(ctx.socket(zmq.ROUTER), pair)
        server.setsockopt(zmq.LINGER, 0)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        second = ctx.socket(zmq.ROUTER)
        with pytest.raises(ConfigError, match="already serves the key pair"):
            secure_server(second, load_keys(_keys(keys.parent / "other")))
        second.close(0)
        client = secure_client(ctx.socket(zmq.DEALER), pair)
        client.setsockopt(zmq.LINGER, 0)
        client.connect(f"tcp://127.0.0.1:{port}")
        client.send(b"in")
        assert server.poll(5000), "the pair's holder was not admitted"
        assert server.recv_multipart()[-1] == b"in"
        stop_guard(ctx)
        late = secure_client(ctx.socket(zmq.DEALER), pair)
        late.setsockopt(zmq.LINGER, 0)
        late.connect(f"tcp://127.0.0.1:{port}")
        late.send(b"late")
        assert not server.poll(1000), "admitted with no handler to ask"
        for s in (server, client, late):
            s.close()
    finally:
        ctx.term()
    # A guarded context terminated without stop_guard (an error path) does not hang.
    ctx = zmq.Context()
    secure_server(ctx.socket(zmq.ROUTER), pair).close(0)
    ended = threading.Event()
    threading.Thread(target=lambda: (ctx.term(), ended.set()), daemon=True).start()
    assert ended.wait(10), "ctx.term() hung on the handler's socket"


def test_a_data_message_at_its_limit_passes_curve_within_the_receivers_headroom(
    keys: Path,
) -> None:
    """ZMQ checks a receiver's MAXMSGSIZE against the frame on the wire, which CURVE makes
    longer: a message at the senders' limit was refused, dropping the link with all it
    queued. Receivers take WIRE_HEADROOM more (here for a limit scaled down to 1000)."""
    pair = load_keys(keys)
    ctx = zmq.Context()
    limit = 1000
    try:
        for receiver_limit, arrives in ((limit, False), (limit + WIRE_HEADROOM, True)):
            server = secure_server(ctx.socket(zmq.PULL), pair)
            server.setsockopt(zmq.LINGER, 0)
            server.setsockopt(zmq.MAXMSGSIZE, receiver_limit)
            port = server.bind_to_random_port("tcp://127.0.0.1")
            client = secure_client(ctx.socket(zmq.PUSH), pair)
            client.setsockopt(zmq.LINGER, 0)
            client.connect(f"tcp://127.0.0.1:{port}")
            client.send(b"x" * limit)
            assert bool(server.poll(3000 if arrives else 1000)) == arrives, receiver_limit
            for s in (server, client):
                s.close()
    finally:
        stop_guard(ctx)
        ctx.term()


async def test_workers_on_hosts_of_their_own_move_data_over_curve(
    keys: Path, tmp_path: Path
) -> None:
    """Each worker as if on a host of its own (distinct host identities: no same-host links,
    no shm), so every chunk crosses a ZeroMQ data socket, each one secured with the pair."""
    err, out = tmp_path / "run.err", tmp_path / "run.out"
    inputs = ROOT / "configs" / "demo-inputs.jsonl"
    procs = [
        start_stagewire(
            "run", str(DEMO), "--external-workers", "--bind", f"tcp://127.0.0.1:{free_port()}",
            "--keys", str(keys), "--input-file", str(inputs), "--requests", "30",
            "--print-outputs", err=err, out=out, env=_env(),
        )
    ]  # fmt: skip
    try:
        text = await workers_announced(err)
        commands = re.findall(r"stagewire worker (--master .*--keys \S+)", text)
        assert len(commands) == 3, text
        for i, command in enumerate(commands):
            procs.append(
                start_stagewire(
                    "worker", *command.split(), "--headless", err=tmp_path / f"w{i}.err",
                    env=_env(STAGEWIRE_HOST_ID=f"host-{i}"),
                )
            )  # fmt: skip
        assert await asyncio.to_thread(procs[0].wait, 120) == 0, err.read_text()
        assert "30/30 requests ok" in err.read_text()
        assert len(out.read_text().splitlines()) == 30
        for p in procs[1:]:
            assert await asyncio.to_thread(p.wait, 30) == 0, p.args
    finally:
        kill_all(procs)
