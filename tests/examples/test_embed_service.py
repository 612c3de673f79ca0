"""The embedding example, run for real: its own process, the pipeline's worker processes,
and a TCP service whose streamed answers must equal the single-process reference."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np

from examples.embed_service import _printable
from pipeline import PipelineSpec
from stages.model import TinyVLM
from stages.payloads import DecodeChunk, VLMRequest
from stages.samples import sample_requests
from tests.pipeline.conftest import wait_for
from tests.procs import alive, children
from tests.stages.conftest import encoded, reference

ROOT = Path(__file__).resolve().parents[2]
_DECODE = PipelineSpec.from_yaml(ROOT / "configs" / "tiny-vlm.yaml").stages["decode"].params
MAX_NEW_TOKENS: int = _DECODE["max_new_tokens"]
CHUNK_TOKENS: int = _DECODE["chunk_tokens"]
#: One request's block of the demo's output.
BLOCK = re.compile(
    r"^\[(\d+)/3\] (.*)\n  streamed: (.*)\n  final:    (.*)\n"
    r"  (\w+) after (\d+) tokens in (\d+) chunks; first token ",
    re.MULTILINE,
)


def _env(cache_dir: Path) -> dict[str, str]:
    """The environment of the example's processes: weights from the tests' cache."""
    return {**os.environ, "STAGEWIRE_CACHE_DIR": str(cache_dir)}


def _text(ids: list[int]) -> str:
    """The text of generated token ids, as the decode stage builds it."""
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


def _fewest_chunks(n: int) -> int:
    """The fewest streamed chunks ``n`` tokens can take: the first alone, then full ones
    (more when decoding runs slowly: a token is not held back past ``chunk_ms``)."""
    return 1 + -(-(n - 1) // CHUNK_TOKENS)


def _check_chunking(sizes: list[int], n: int) -> None:
    """The first token alone, then chunks of 1 to ``chunk_tokens`` tokens, ``n`` in all."""
    assert sizes[0] == 1 and all(1 <= s <= CHUNK_TOKENS for s in sizes), sizes
    assert sum(sizes) == n and len(sizes) >= _fewest_chunks(n)


def test_the_demo_prints_each_answer_as_it_streams_then_the_final_text(
    cache_dir: Path, model: TinyVLM
) -> None:
    """The documented command exits 0 having printed, per request, the streamed text in
    as many chunks as the tokens need, equal to the final text and to the reference."""
    run = subprocess.run(
        [sys.executable, "-m", "examples.embed_service"],
        cwd=ROOT,
        env=_env(cache_dir),
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "serving tiny-vlm on 127.0.0.1:" in run.stderr
    assert "Traceback" not in run.stderr
    blocks = BLOCK.findall(run.stdout)
    assert [b[0] for b in blocks] == ["1", "2", "3"], run.stdout
    for request, (_, prompt, streamed, final, stop, tokens, chunks) in zip(
        sample_requests(3), blocks, strict=True
    ):
        want = reference(model, request, MAX_NEW_TOKENS)
        assert prompt.startswith(repr(request.prompt))
        assert streamed == final == _printable(_text(want))
        assert int(tokens) == len(want)
        assert len(want) >= int(chunks) >= _fewest_chunks(len(want)) > 1
        assert stop == ("max_new_tokens" if len(want) == MAX_NEW_TOKENS else "eos")


async def _port(stderr: asyncio.StreamReader) -> int:
    """The port the service announces on stderr once its pipeline is up."""
    while line := await stderr.readline():
        if found := re.match(rb"serving tiny-vlm on 127\.0\.0\.1:(\d+)", line):
            return int(found[1])
    raise AssertionError("the service exited without announcing its port")


async def _reply(reader: asyncio.StreamReader) -> list[dict[str, object]]:
    """Every reply line to one request: its chunks up to the final one, or one error."""
    lines: list[dict[str, object]] = []
    while not lines or not (lines[-1].get("done") or "error" in lines[-1]):
        line = await reader.readline()
        assert line, "the service hung up mid-reply"
        lines.append(msgspec.json.decode(line))
    return lines


async def test_the_service_streams_chunks_fails_bad_lines_alone_and_stops_on_sigterm(
    cache_dir: Path, model: TinyVLM
) -> None:
    """Over TCP, answers stream chunk by chunk and equal the reference, bad requests get
    one error line and the next is served, and SIGTERM exits 0 with every worker gone."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "examples.embed_service",
        "--serve",
        cwd=ROOT,
        env=_env(cache_dir),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stderr is not None
    stalled: socket.socket | None = None
    try:
        async with asyncio.timeout(60):
            port = await _port(proc.stderr)
        workers = children(proc.pid)
        assert len(workers) == 4
        good = sample_requests(2)
        gif = VLMRequest(prompt="hi", image=encoded(np.zeros((8, 8, 3), np.uint8), "GIF"))
        lines = [
            msgspec.json.encode(good[0]) + b"\n",
            b"not json\n",
            msgspec.json.encode(gif) + b"\n",
            msgspec.json.encode(good[1]) + b"\n",
            b'{"prompt": "hi", "imgae": ""}\n',  # a misspelt field was ignored
            b'{"prompt": ' + b"[" * 100_000 + b"\n",
            b'{"prompt": "\xff\xfe"}\n',
            msgspec.json.encode(good[0]) + b"\n",
        ]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        replies = []
        async with asyncio.timeout(30):
            for line in lines:
                writer.write(line)
                await writer.drain()
                replies.append(await _reply(reader))
        writer.close()
        await writer.wait_closed()

        for request, reply in zip(good, (replies[0], replies[3]), strict=True):
            want = reference(model, request, MAX_NEW_TOKENS)
            *progress, final = (msgspec.convert(r, DecodeChunk) for r in reply)
            _check_chunking([len(c.token_ids) for c in progress], len(want))
            assert [t for c in progress for t in c.token_ids] == final.generated_ids == want
            assert "".join(c.text_delta for c in progress) == final.text == _text(want)
            assert final.done and not any(c.done for c in progress)
        assert replies[1] == [{"error": replies[1][0]["error"]}]
        assert str(replies[1][0]["error"]).startswith("bad request line: JSON is malformed")
        assert len(replies[2]) == 1
        assert "InvalidRequest: image is a GIF, not a PNG or JPEG" in str(replies[2][0]["error"])
        assert replies[4] == [{"error": "bad request line: Object contains unknown field `imgae`"}]
        # Nested too deeply for the decoder, or not UTF-8: an error line each, and the
        # connection serves on (one was dropped without a word, the other called too long).
        for reply in replies[5:7]:
            assert len(reply) == 1 and str(reply[0]["error"]).startswith("bad request line: ")
        assert len(replies[7]) > 1 and replies[7][-1]["done"]

        # A client that stops reading while its replies pile up: SIGTERM must not wait for
        # it (closing its connection waited to send them, for ever).
        stalled = await _stalled_client(port)
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
            # Workers share the stderr pipe, so its end means they have all exited too.
            err = (await proc.stderr.read()).decode()
        assert "Traceback" not in err

        async def gone() -> bool:
            return not any(alive(pid) for pid in workers)

        await wait_for(gone)
    finally:
        if stalled is not None:
            stalled.close()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _stalled_client(port: int) -> socket.socket:
    """A connection that sends requests whose error replies are 1 MiB each (they name an
    unknown field that long) and reads none of them, until the service stops reading."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    line = b'{"prompt": "x", "' + b"A" * 2**20 + b'": 1}\n'
    for _ in range(32):
        try:
            await asyncio.wait_for(loop.sock_sendall(sock, line), 2)
        except TimeoutError:
            break  # the service waits for this client to read
    return sock


def test_a_port_in_use_or_a_missing_config_is_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    """A port in use was a traceback once the whole pipeline had started; a missing config
    a traceback too."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for args, said in (
            (["--port", str(port)], f"error: cannot listen on 127.0.0.1:{port}: "),
            (["--config", str(tmp_path / "none.yaml")], "error: "),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "examples.embed_service", "--serve", *args],
                cwd=ROOT, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 2, done.stderr
            assert done.stderr.startswith(said) and done.stderr.count("\n") == 1, done.stderr
    # No port at all: argparse's usage line and error (an OverflowError traceback before).
    done = subprocess.run(
        [sys.executable, "-m", "examples.embed_service", "--port", "70000"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "70000 is not a TCP port" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
