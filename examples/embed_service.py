"""A Python service that embeds the tiny-VLM pipeline and streams its tokens to clients.

The service starts the pipeline once, with ``async with Pipeline.from_yaml(...)``, and
serves it over a line protocol on TCP. Each line a client sends is one request: a JSON
``VLMRequest``, exactly like a line of ``stages/assets/requests.jsonl``. Each line sent back
is one ``DecodeChunk`` as JSON, streamed as the tokens are generated, the last one marked
``"done": true`` with the whole text, stop reason and timings; a request that fails gets
one ``{"error": "..."}`` line instead. Run it from the repository root::

    .venv/bin/python -m examples.embed_service                # demo: 3 sample requests
    .venv/bin/python -m examples.embed_service --requests 12
    .venv/bin/python -m examples.embed_service --serve --port 8765
    nc 127.0.0.1 8765 < stages/assets/requests.jsonl          # from another terminal

Without ``--serve`` the program is its own client: it sends the shipped sample requests
over the socket and prints each answer's text as its tokens arrive ("streamed"), then the
final chunk's whole text, stop reason and timings. With ``--serve`` it serves until Ctrl-C
(exit 130) or SIGTERM (exit 0). The first run generates the model's weights into
``$STAGEWIRE_CACHE_DIR`` (default ``~/.cache/stagewire``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec

from pipeline import ConfigError, Pipeline, PipelineError
from stages.payloads import DecodeChunk, VLMRequest
from stages.samples import sample_requests

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-vlm.yaml"
#: Longest request line read: images travel base64-encoded inside it, so allow photos.
MAX_LINE = 16 * 2**20


class Failed(msgspec.Struct):
    """The one reply line of a request that failed."""

    error: str


class RequestFailed(Exception):
    """The service answered a request with an error line."""


class TokenService:
    """Serves one running pipeline to any number of TCP connections."""

    def __init__(self, pipe: Pipeline) -> None:
        self._pipe = pipe
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer each request line of one connection in turn, until the client hangs up."""
        task = asyncio.current_task()
        assert task is not None
        self._clients[task] = writer
        try:
            while line := await reader.readline():
                await self._answer(line, writer)
        except ValueError:
            # readline() refuses a line over MAX_LINE; the rest of it cannot be skipped.
            writer.write(_line(Failed(f"request line over {MAX_LINE} bytes; closing")))
        except ConnectionError:
            pass  # The client went away; leaving the stream aborted its request.
        finally:
            del self._clients[task]
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _answer(self, line: bytes, writer: asyncio.StreamWriter) -> None:
        """Stream the reply to one request line: its chunks as they come, or one error."""
        try:
            request = _request(line)
            # Leaving this block early (the client hung up, the service is closing) aborts
            # the request in every stage, so no stage goes on working for nobody.
            async with self._pipe.stream(request) as stream:
                async for chunk in stream:
                    writer.write(_line(chunk))
                    # A slow reader slows its own request down, and no other.
                    await writer.drain()
        # DecodeError, UnicodeDecodeError and the rest of _request's are ValueErrors.
        except ValueError as e:
            writer.write(_line(Failed(f"bad request line: {e}")))
        except PipelineError as e:
            # A bad image or prompt fails this request alone, as a StageError saying why.
            writer.write(_line(Failed(str(e))))
        await writer.drain()

    async def aclose(self) -> None:
        """Hang up on every client still connected, and wait for their handlers to end.

        An idle handler ends at once; one mid-reply ends at its next chunk, when writing to
        the closed connection fails, and that aborts its request in every stage. Closing
        connections rather than cancelling handlers keeps asyncio's server code quiet. They
        are aborted, not closed: a close first sends what is buffered, and a handler waiting
        for a client that stopped reading would wait with it, for ever.
        """
        for writer in self._clients.values():
            writer.transport.abort()
        if self._clients:
            await asyncio.wait(list(self._clients))


class _RequestLine(VLMRequest, forbid_unknown_fields=True):
    """A request as a line holds it: a field it does not know is an error, as in
    ``stagewire`` (a misspelt one would be ignored)."""


_decode_line = msgspec.json.Decoder(_RequestLine).decode


def _request(line: bytes) -> VLMRequest:
    """The request a line holds.

    Raises:
        ValueError: the line is not JSON, not a request, names an unknown field, nests too
            deeply or is not UTF-8 (the message says which).
    """
    try:
        return _decode_line(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _line(reply: msgspec.Struct) -> bytes:
    return msgspec.json.encode(reply) + b"\n"


async def ask(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: VLMRequest
) -> AsyncIterator[DecodeChunk]:
    """Send ``request`` to the service and yield its reply chunks as they arrive.

    Raises:
        RequestFailed: the service answered with an error.
        ConnectionError: the service closed the connection mid-reply.
    """
    writer.write(_line(request))
    await writer.drain()
    while line := await reader.readline():
        reply = msgspec.json.decode(line)
        if "error" in reply:
            raise RequestFailed(reply["error"])
        chunk = msgspec.convert(reply, DecodeChunk)
        yield chunk
        if chunk.done:
            return
    raise ConnectionError("the service closed the connection mid-reply")


def _printable(text: str) -> str:
    """``text`` with control characters escaped: an untrained model emits any bytes."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


async def demo(port: int, requests: Sequence[VLMRequest]) -> None:
    """Be a client of the service on ``port``: send ``requests`` and print the answers.

    Raises:
        RequestFailed: the service answered a request with an error.
        ConnectionError: the service closed the connection.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, request in enumerate(requests, 1):
            print(
                f"[{i}/{len(requests)}] {request.prompt!r} with a {len(request.image)}-byte image"
            )
            print("  streamed: ", end="", flush=True)
            sent = time.perf_counter()
            first_ms, chunks = 0.0, 0
            async for chunk in ask(reader, writer, request):
                if not chunk.done:
                    # Print each piece of text the moment it arrives.
                    first_ms = first_ms or (time.perf_counter() - sent) * 1000
                    chunks += 1
                    print(_printable(chunk.text_delta), end="", flush=True)
                    continue
                print(f"\n  final:    {_printable(chunk.text)}")
                print(
                    f"  {chunk.stop_reason} after {len(chunk.generated_ids)} tokens in {chunks} "
                    f"chunks; first token {first_ms:.1f} ms after sending "
                    f"({chunk.timings['first_token_ms']:.1f} ms of it in decode), "
                    f"{chunk.timings['tokens_per_s']:.0f} tokens/s",
                    flush=True,
                )
    finally:
        writer.close()
        await writer.wait_closed()


async def serve(config: Path, listening: socket.socket, *, requests: int, forever: bool) -> None:
    """Start the pipeline and serve it on ``listening``; run the demo client, or serve
    until SIGTERM.

    Raises:
        ConfigError: the pipeline's YAML is invalid, or not there.
        PipelineError: the pipeline failed to start.
        RequestFailed: a demo request failed.
    """
    async with Pipeline.from_yaml(config) as pipe:
        service = TokenService(pipe)
        server = await asyncio.start_server(service.handle, sock=listening, limit=MAX_LINE)
        try:
            port = server.sockets[0].getsockname()[1]
            print(f"serving {pipe.spec.name} on 127.0.0.1:{port}", file=sys.stderr, flush=True)
            if forever:
                stop = asyncio.Event()
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
                await stop.wait()
            else:
                await demo(port, sample_requests(requests))
        finally:
            server.close()
            await service.aclose()
            await server.wait_closed()


def _port(text: str) -> int:
    """A TCP port number, 0 (any free one) to 65535."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0 to 65535)")
    return port


def main(argv: Sequence[str] | None = None) -> int:
    """Run the example; returns the exit code (0 ok, 1 a request failed, 2 a bad config or
    port, 3 the pipeline did not start, 130 Ctrl-C)."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.embed_service",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=CONFIG, help="the pipeline's YAML")
    parser.add_argument("--port", type=_port, default=0, help="TCP port (default: any free one)")
    parser.add_argument("--requests", type=int, default=3, help="sample requests the demo sends")
    parser.add_argument("--serve", action="store_true", help="serve until SIGTERM or Ctrl-C")
    args = parser.parse_args(argv)
    try:
        # Bound first: a port in use is refused at once, not after the pipeline has started.
        listening = socket.create_server(("127.0.0.1", args.port))
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        with listening:
            asyncio.run(serve(args.config, listening, requests=args.requests, forever=args.serve))
    except RequestFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except PipelineError as e:
        print(f"error: the pipeline did not start: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
