"""Stages used by the runtime tests; worker processes import them by path."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, TextIO

import msgspec
from pydantic import BaseModel, field_validator

from pipeline import (
    ChunkGap,
    Context,
    Outputs,
    PayloadError,
    Stage,
    StageUnavailable,
    Stream,
    TransportError,
)
from stages.text import Text, Token

#: Simulated compute before each chunk of Crunch.
CRUNCH_S = 0.25
#: Simulated work of a batch (not a synchronisation: the stage is doing its job).
BATCH_WORK_S = 0.001
#: How long Count is busy with a stream whose first word is "sleep".
COUNT_BUSY_S = 3.0
#: Simulated work of a Gauge request: long enough that concurrent arrivals overlap even on
#: a loaded machine, so the peak reaches max_concurrency.
GAUGE_WORK_S = 0.25


class Echo(Stage):
    """Returns its input; fails on 'boom', returns a wrong type on 'badtype', ends its
    process with code N on 'exitN' (as a library calling exit would)."""

    async def process(self, text: Text, ctx: Context) -> Text:
        if text.value.startswith("exit") and text.value[4:].isdigit():
            os._exit(int(text.value[4:]))
        if "boom" in text.value:
            raise ValueError(f"cannot echo {text.value!r}")
        if text.value == "badtype":
            return Token(0, "not a Text")  # type: ignore[return-value]  # on purpose
        if text.value.startswith("sleep"):
            await asyncio.sleep(float(text.value.split()[1]))
        return Text(text.value)


class Tokens(Stage):
    """Streams the words of a text; 'stall' stops after one token and never ends."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Token]:
        for i, word in enumerate(text.value.split()):
            if word == "stall" and i > 0:
                await asyncio.Event().wait()  # never set: the stream stalls until aborted
            yield Token(i, word)


class Crunch(Stage):
    """Streams the words of a text, computing (holding its loop) for CRUNCH_S before each."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Token]:
        for i, word in enumerate(text.value.split()):
            # Compute that holds the loop, as a model layer does: no await until the yield.
            deadline = time.perf_counter() + CRUNCH_S
            spins = 0
            while time.perf_counter() < deadline:
                spins += 1
            yield Token(i, word)


class Relay(Stage):
    """Passes tokens on as they arrive; fails the request on the token 'boom'."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> AsyncIterator[Token]:
        async for token in tokens:
            if token.value == "boom":
                raise RuntimeError("relay refused 'boom'")
            yield token


class Collect(Stage):
    """Joins tokens, checking their order."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        words: list[str] = []
        async for token in tokens:
            assert token.index == len(words), (token.index, len(words))
            words.append(token.value)
        return Text(" ".join(words))


class Lingers(Stage):
    """Joins its tokens, then works on until a line comes through the FIFO named by the
    LINGER_FIFO environment variable (at most 60 s): a long decode going on after its
    input's producer has finished its part, for as long as the test needs."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        words = [token.value async for token in tokens]
        await _line_through_fifo()
        return Text(" ".join(words))


class HoldsLoop(Stage):
    """Joins its tokens, then holds its event loop, as a long model step would (a blocking
    read, which lets other threads run), until a line comes through the FIFO named by
    LINGER_FIFO, or the FIFO closes."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        words = [token.value async for token in tokens]
        with open(os.environ["LINGER_FIFO"]) as fifo:  # noqa: ASYNC230  # holds the loop
            fifo.readline()
        return Text(" ".join(words))


class RelaysOneThenHolds(Stage):
    """Relays the first token of its stream; its loop stays free until a line comes through
    the FIFO named by LINGER_FIFO (the token leaves meanwhile); then it touches the file
    HOLD_MARK names and at once holds its loop, as a long model step would, until a second
    line comes or the FIFO closes; it relays nothing more."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> AsyncIterator[Token]:
        async for token in tokens:
            yield token

            def first_line() -> TextIO:
                fifo = open(os.environ["LINGER_FIFO"])  # noqa: SIM115  # read on the loop below
                fifo.readline()
                return fifo

            fifo = await asyncio.to_thread(first_line)
            with fifo:
                # No await from here on: once the mark is there, the loop is held.
                Path(os.environ["HOLD_MARK"]).touch()  # noqa: ASYNC240  # holds, on purpose
                fifo.readline()
            return


class FirstWhenTold(Stage):
    """Returns the first token of its stream once a line comes through the FIFO named by
    LINGER_FIFO, leaving the rest unread."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        async for token in tokens:
            await _line_through_fifo()
            return Text(token.value)
        return Text("")


class TokensWhenTold(Stage):
    """Streams the words of a text once a line comes through the FIFO named by LINGER_FIFO."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Token]:
        await _line_through_fifo()
        for i, word in enumerate(text.value.split()):
            yield Token(i, word)


class TakesSrcOnly(Stage):
    """Joins 'src' and 'p' for a request, and returns src's text without reading p."""

    async def process(self, src: Text, p: Stream[Token], ctx: Context) -> Text:
        return src


class EchoWhenTold(Stage):
    """Returns its input once a line comes through the FIFO named by LINGER_FIFO."""

    async def process(self, text: Text, ctx: Context) -> Text:
        await _line_through_fifo()
        return text


async def _line_through_fifo() -> None:
    """Wait (at most 60 s) for a line through the FIFO that env LINGER_FIFO names."""

    def released() -> str:
        with open(os.environ["LINGER_FIFO"]) as fifo:  # blocks until a writer opens it
            return fifo.readline()

    await asyncio.wait_for(asyncio.to_thread(released), 60)


class _NoMessage(Exception):
    """An exception whose own ``__str__`` fails."""

    def __str__(self) -> str:
        raise AttributeError("no detail")


class _LibraryAbort(BaseException):
    """A library's own BaseException (as greenlet's GreenletExit): no Exception."""


class Misbehaves(Stage):
    """Echoes; fails as its input says, in ways a handler's own code may."""

    async def process(self, text: Text, ctx: Context) -> Text:
        match text.value:
            case "sys.exit":
                raise SystemExit(3)
            case "base exception":
                raise _LibraryAbort("aborted by the library")
            case "keyboard interrupt":
                raise KeyboardInterrupt
            case "no message":
                raise _NoMessage
            case "huge message":
                # Past every control message's size cap, were it sent whole.
                raise ValueError("x" * 70_000_000)
            case "huge transport error":
                raise TransportError("x" * 70_000_000)
            case "file name not utf-8":
                # What os.listdir makes of a name that is not UTF-8: a lone surrogate.
                raise FileNotFoundError(f"no file {os.fsdecode(b'caf' + bytes([0xE9]))}")
            case "another pipeline's gap":
                raise ChunkGap("a-request-of-another-pipeline", "x->y", 3, 1.0)
            case "another pipeline's stage":
                raise StageUnavailable("inner", "it died", request_id="another-request")
            case "another pipeline's stage, no id":
                # As another pipeline's submit() raises it when it has no ready replica.
                raise StageUnavailable("inner", "no replica is ready after waiting 1s")
        return text

    async def process_batch(self, texts: list[Text], ctxs: list[Context]) -> list[Text]:
        """As process, for a whole batch."""
        if any(t.value == "sys.exit" for t in texts):
            raise SystemExit(3)
        if any(t.value == "base exception" for t in texts):
            raise _LibraryAbort("aborted by the library")
        return texts


class HoldsOnCancelled(Stage):
    """On "swallow", catches its first cancellation and waits on (a bug: it holds its slot);
    a second ends it. Echoes anything else."""

    async def process(self, text: Text, ctx: Context) -> Text:
        if text.value == "swallow":
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
            await asyncio.Event().wait()
        return text


class SomeBad(Stage):
    """Streams ``int(text.value)`` tokens, every second one malformed (its index a string,
    where the consumer's Token wants an int), as a producer with a bug would."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Token]:
        for i in range(int(text.value)):
            yield Token("bad" if i % 2 else i, "x")  # type: ignore[arg-type]  # on purpose


class SkipsBad(Stage):
    """Reads its stream on past the chunks that do not decode; says how many of each."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        good = bad = 0
        while True:
            try:
                await anext(tokens)
            except StopAsyncIteration:
                return Text(f"{good} good, {bad} bad")
            except PayloadError:
                bad += 1
            else:
                good += 1


class First(Stage):
    """Returns the first token of its stream, leaving the rest unread."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        async for token in tokens:
            return Text(token.value)
        return Text("")


class Count(Stage):
    """Counts the tokens of its stream; on "sleep S" first, it sleeps S seconds before it
    reads, as a model's step might (not a synchronisation: the stage is busy)."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        n = 0
        async for token in tokens:
            if n == 0 and token.value == "sleep":
                await asyncio.sleep(COUNT_BUSY_S)
            n += 1
        return Text(str(n))


class Branches(Outputs):
    """A token for one of two downstream stages."""

    first: Token | None = None
    count: Token | None = None


class ToFirstThenCount(Stage):
    """Streams ``int(text)`` tokens to 'first', then one token to 'count'."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Branches]:
        n = int(text.value)
        for i in range(n):
            yield Branches(first=Token(i, f"t{i}"))
        yield Branches(count=Token(n, "last"))


async def _await_a_cancelled_helper() -> None:
    """Await a helper task that something else cancels: CancelledError, request or not."""
    helper = asyncio.ensure_future(asyncio.Event().wait())  # ends only when cancelled
    asyncio.get_running_loop().call_soon(helper.cancel)
    await helper


class CancelledInside(Stage):
    """Echoes, but on 'cancel' awaits a helper task that gets cancelled; batches if asked."""

    async def process(self, text: Text, ctx: Context) -> Text:
        if text.value == "cancel":
            await _await_a_cancelled_helper()
        return text

    async def process_batch(self, texts: list[Text], ctxs: list[Context]) -> list[Text]:
        if any(t.value == "cancel" for t in texts):
            await _await_a_cancelled_helper()
        return list(texts)


class Blob(msgspec.Struct):
    """A large opaque payload."""

    seq: int
    data: bytes


class Flood(Stage):
    """Streams ``count`` blobs of ``size`` bytes as fast as it can."""

    class Params(BaseModel):
        count: int = 1000
        size: int = 256 * 1024

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Blob]:
        assert isinstance(self.params, Flood.Params)
        data = os.urandom(self.params.size)
        for i in range(self.params.count):
            yield Blob(i, data)


class FloodN(Flood):
    """Streams int(text) blobs of ``size`` bytes."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Blob]:
        assert isinstance(self.params, Flood.Params)
        data = os.urandom(self.params.size)
        for i in range(int(text.value)):
            yield Blob(i, data)


def numbered(seq: int, size: int) -> bytes:
    """The payload of chunk ``seq`` of Numbered: its bytes say which chunk it is."""
    return seq.to_bytes(4, "little") * (size // 4)


class Numbered(Stage):
    """Streams int(text) blobs of ``size`` bytes, each filled by :func:`numbered`."""

    class Params(BaseModel):
        size: int = 256 * 1024

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Blob]:
        assert isinstance(self.params, Numbered.Params)
        for i in range(int(text.value)):
            yield Blob(i, numbered(i, self.params.size))


class PassBlobs(Stage):
    """Passes blobs on as they arrive."""

    async def process(self, blobs: Stream[Blob], ctx: Context) -> AsyncIterator[Blob]:
        async for blob in blobs:
            yield blob


class Drain(Stage):
    """Consumes blobs slowly and reports how many came, in order."""

    class Params(BaseModel):
        delay: float = 0.002

    async def process(self, blobs: Stream[Blob], ctx: Context) -> Text:
        assert isinstance(self.params, Drain.Params)
        n = 0
        async for blob in blobs:
            assert blob.seq == n
            n += 1
            await asyncio.sleep(self.params.delay)
        return Text(str(n))


class Pixels(msgspec.Struct):
    """Stand-in for image pixels."""

    values: list[int]


class Ids(msgspec.Struct):
    """Stand-in for token ids."""

    ids: list[int]


class Split(Outputs):
    """Different payloads for different downstream stages."""

    encode: Pixels
    prefill: Ids


class Pre(Stage):
    """Sends pixels to 'encode' and ids to 'prefill'; on "mixed up", ids to both."""

    async def process(self, text: Text, ctx: Context) -> Split:
        codes = [ord(c) for c in text.value]
        if text.value == "mixed up":
            return Split(encode=Ids(codes), prefill=Ids(codes))  # type: ignore[arg-type]
        return Split(encode=Pixels(codes), prefill=Ids([len(codes)]))


class Encode(Stage):
    """Doubles the pixel values."""

    async def process(self, pixels: Pixels, ctx: Context) -> Pixels:
        return Pixels([v * 2 for v in pixels.values])


#: How long SlowEncode takes per request.
SLOW_ENCODE_S = 0.3


class SlowEncode(Stage):
    """Doubles the pixel values, taking SLOW_ENCODE_S (a model's forward, say)."""

    async def process(self, pixels: Pixels, ctx: Context) -> Pixels:
        await asyncio.sleep(SLOW_ENCODE_S)
        return Pixels([v * 2 for v in pixels.values])


class GatedEncode(Stage):
    """Doubles the pixel values once a line comes through the FIFO named by LINGER_FIFO: a
    model's forward that takes as long as the test needs."""

    async def process(self, pixels: Pixels, ctx: Context) -> Pixels:
        await _line_through_fifo()
        return Pixels([v * 2 for v in pixels.values])


class Prefill(Stage):
    """Joins ids from 'pre' and pixels from 'encode' for the same request."""

    async def process(self, pre: Ids, encode: Pixels, ctx: Context) -> Text:
        assert pre.ids == [len(encode.values)]
        return Text("".join(chr(v // 2) for v in encode.values) + f"|{pre.ids[0]}")


class Batched(Stage):
    """Upper-cases texts in batches, tagging each with the size of its batch."""

    async def process(self, text: Text, ctx: Context) -> Text:
        return (await self.process_batch([text], [ctx]))[0]

    async def process_batch(self, texts: list[Text], ctxs: list[Context]) -> list[Text]:
        await asyncio.sleep(BATCH_WORK_S)
        return [Text(f"{t.value.upper()}#{len(texts)}") for t in texts]


class Gauge(Stage):
    """Reports how many requests run in this replica at once (for max_concurrency)."""

    running = 0
    peak = 0

    async def process(self, text: Text, ctx: Context) -> Text:
        Gauge.running += 1
        Gauge.peak = max(Gauge.peak, Gauge.running)
        try:
            await asyncio.sleep(GAUGE_WORK_S)
            return Text(f"{self.replica}:{Gauge.peak}")
        finally:
            Gauge.running -= 1


class BrokenSetup(Stage):
    """Fails in setup, as a stage whose model cannot load would."""

    async def setup(self) -> None:
        raise OSError("weights file is missing")

    async def process(self, text: Text, ctx: Context) -> Text:
        return text


def _start_flakily(marker: Path) -> None:
    if not marker.exists():
        marker.write_text("started")
    elif marker.read_text() == "started":
        marker.write_text("failed once")
        raise MemoryError("out of device memory (its predecessor's is still held)")


class FlakySetup(Stage):
    """Echoes. Its setup fails once, at its first restart (a transient error, as memory its
    crashed predecessor still held); every other start succeeds. The file named by the
    FLAKY_MARKER environment variable records the starts."""

    async def setup(self) -> None:
        await asyncio.to_thread(_start_flakily, Path(os.environ["FLAKY_MARKER"]))

    async def process(self, text: Text, ctx: Context) -> Text:
        return text


def _start_once(marker: Path) -> None:
    if marker.exists():
        raise OSError("weights file is missing")
    marker.write_text("started")


class BreaksWhenRestarted(Stage):
    """Echoes. Its first start succeeds; every later one fails in setup, as a stage whose
    model file went missing since would. The file named by BREAK_MARKER notes the first."""

    async def setup(self) -> None:
        await asyncio.to_thread(_start_once, Path(os.environ["BREAK_MARKER"]))

    async def process(self, text: Text, ctx: Context) -> Text:
        return text


class Hog(Stage):
    """Holds the event loop with CPU work for the given seconds, like a large prefill."""

    async def process(self, text: Text, ctx: Context) -> Text:
        end = time.monotonic() + float(text.value)
        while time.monotonic() < end:
            pass
        return text


#: Simulated model-loading time of SlowSetupRelay.
SLOW_SETUP_S = 1.5


class SlowSetupRelay(Relay):
    """A relay whose setup takes a while, as loading a model does."""

    async def setup(self) -> None:
        await asyncio.sleep(SLOW_SETUP_S)


class HangingSetup(Echo):
    """An echo whose setup never returns (a model load that hangs)."""

    async def setup(self) -> None:
        await asyncio.Event().wait()


class HangsWhenRestarted(Echo):
    """An echo that sets up at once the first time, and whose setup never returns in every
    later process (the file HANG_MARKER names says it ran once)."""

    async def setup(self) -> None:
        mark = Path(os.environ["HANG_MARKER"])
        if mark.exists():  # noqa: ASYNC240  # a marker file, read once
            await asyncio.Event().wait()
        mark.touch()  # noqa: ASYNC240


class SaysItsReplica(Stage):
    """Answers with its replica's index; given 'hold', it first holds its event loop, as a
    handler that never gives it back would, until a line comes through the FIFO named by
    LINGER_FIFO."""

    async def process(self, text: Text, ctx: Context) -> Text:
        if text.value == "hold":
            with open(os.environ["LINGER_FIFO"]) as fifo:  # noqa: ASYNC230  # holds the loop
                fifo.readline()
        return Text(str(ctx.replica))


class AnswersItsCancellation(Stage):
    """Waits for ever; cancelled (its request aborted), it catches the cancellation and
    answers all the same, or raises when the text is 'raise'."""

    async def process(self, text: Text, ctx: Context) -> Text:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if text.value == "raise":
                raise ValueError("cancelled") from None
        return text


class Parcel(msgspec.Struct):
    """A text with a large payload alongside."""

    text: str
    data: bytes


class Numbers(msgspec.Struct):
    """Integers to add up."""

    values: list[int]


class Sums(Stage):
    """Answers the sum of its numbers."""

    async def process(self, numbers: Numbers, ctx: Context) -> Text:
        return Text(str(sum(numbers.values)))


class Wraps(Stage):
    """Sends its text on with ``size`` bytes alongside."""

    class Params(BaseModel):
        size: int = 3 * 1024 * 1024

    async def process(self, text: Text, ctx: Context) -> Parcel:
        assert isinstance(self.params, Wraps.Params)
        return Parcel(text.value, bytes(self.params.size))


class Unwraps(Stage):
    """Answers "TEXT@REPLICA"; a text "hold:PATH" first touches PATH.taken, then awaits
    (its loop free) a line through the FIFO at PATH."""

    async def process(self, parcel: Parcel, ctx: Context) -> Text:
        if parcel.text.startswith("hold:"):
            Path(parcel.text.removeprefix("hold:") + ".taken").touch()  # noqa: ASYNC240

            def released() -> str:
                with open(parcel.text.removeprefix("hold:")) as fifo:
                    return fifo.readline()

            await asyncio.wait_for(asyncio.to_thread(released), 60)
        return Text(f"{parcel.text}@{ctx.replica}")


class SlowTeardown(Echo):
    """An echo whose teardown touches the file HOLD_MARK names, then awaits (its loop free)
    a line through the FIFO named by LINGER_FIFO: a teardown that flushes something slow."""

    async def teardown(self) -> None:
        Path(os.environ["HOLD_MARK"]).touch()  # noqa: ASYNC240
        await _line_through_fifo()


class Prints(Echo):
    """An echo that prints to stdout, in setup and per request, as debugging code does."""

    async def setup(self) -> None:
        print("set up", flush=True)

    async def process(self, text: Text, ctx: Context) -> Text:
        print(f"echoing {text.value}", flush=True)
        return text


class ExitsInSetup(Echo):
    """An echo whose setup calls sys.exit with a reason, as a script's loading code may."""

    async def setup(self) -> None:
        raise SystemExit("model file weights.bin not found")


class SetupErrorNotUtf8(Echo):
    """An echo whose setup fails naming a file whose name is not UTF-8."""

    async def setup(self) -> None:
        raise OSError(f"cannot load {os.fsdecode(b'caf' + bytes([0xE9]))}")


class HugeSetupError(Echo):
    """An echo whose setup fails with a message past every control message's size cap."""

    async def setup(self) -> None:
        raise ValueError("x" * 70_000_000)


class AwaitsAStuckThread(Stage):
    """Awaits a thread that never returns (it waits on an event nobody sets), then touches
    the file HOLD_MARK names; cancelled, the thread stays."""

    async def process(self, text: Text, ctx: Context) -> Text:
        never = threading.Event()
        thread = asyncio.ensure_future(asyncio.to_thread(never.wait))
        await asyncio.sleep(0)  # the thread is started
        Path(os.environ["HOLD_MARK"]).touch()  # noqa: ASYNC240
        await thread
        return text


class SpinsForever(Stage):
    """Touches the file HOLD_MARK names, then holds its event loop for good in a Python
    loop (a model step caught in a loop): nothing it awaits ever runs again."""

    async def process(self, text: Text, ctx: Context) -> Text:
        Path(os.environ["HOLD_MARK"]).touch()  # noqa: ASYNC240  # holds, on purpose
        while True:
            pass


class Counted(Stage):
    """Echoes, and reports counters of its own (and a value that is not a number)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.echoed = 0

    async def process(self, text: Text, ctx: Context) -> Text:
        self.echoed += 1
        return text

    def statistics(self) -> dict[str, int | float]:
        import numpy as np  # here: a worker of the other sample stages must not load it

        odd: dict[str, object] = {
            "label": "not a number",
            "bytes_seen": 2**70,  # past 64 bits
            "np_count": np.int64(self.echoed),
            "np_rate": np.float32(0.5),
        }
        return {"echoed": self.echoed, "half": self.echoed / 2, **odd}  # type: ignore[dict-item]


class RelayedError(Stage):
    """Fails every request with an error that a background task of the replica raised,
    caught and handed over, and the task goes on serving the next request."""

    async def setup(self) -> None:
        self._jobs: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()
        self._server = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        while True:
            job = await self._jobs.get()
            try:
                raise ValueError("relayed from the background task")
            except ValueError as exc:
                job.set_exception(exc)

    async def process(self, text: Text, ctx: Context) -> Text:
        job: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._jobs.put(job)
        await job  # raises the background task's error, its frame in the traceback
        return text

    async def teardown(self) -> None:
        self._server.cancel()


class CollectorState(Stage):
    """Reports its worker's garbage collector: in setup, and while serving."""

    async def setup(self) -> None:
        self.in_setup = gc.isenabled()

    async def process(self, text: Text, ctx: Context) -> Text:
        frozen = gc.get_freeze_count()
        return Text(f"setup:{self.in_setup} serving:{gc.isenabled()} frozen:{frozen}")


class WhoAmI(Stage):
    """Says what its Context says, and logs through ``ctx.log``. 'spin' runs a CPU loop in
    a thread, polling ``ctx.cancelled`` as such a loop must (cancelling the awaiting task
    does not stop a thread), and counts the loops that stopped that way."""

    async def setup(self) -> None:
        self.spinning = self.stopped = 0

    def _spin(self, ctx: Context) -> None:
        self.spinning += 1
        deadline = time.monotonic() + 60
        while not ctx.cancelled and time.monotonic() < deadline:
            sum(range(10_000))  # a slice of the loop's work, then a look at ctx.cancelled
        if ctx.cancelled:
            self.stopped += 1

    def statistics(self) -> dict[str, int]:
        return {"spinning": self.spinning, "stopped": self.stopped}

    async def process(self, text: Text, ctx: Context) -> Text:
        ctx.log.warning("who_am_i", said=text.value)
        if text.value == "spin":
            await asyncio.to_thread(self._spin, ctx)
        return Text(f"{ctx.request_id}|{ctx.stage}|{ctx.replica}|{ctx.cancelled}")


class SteppedBatch(Stage):
    """Upper-cases texts in batches. A batch holding the text "hold" first writes "running N"
    (its size) to the file named by the STEP_MARKER environment variable, then computes in
    steps of 10 ms for 5 s, calling each request's ``ctx.checkpoint()`` between steps as a
    long batched computation does."""

    async def process(self, text: Text, ctx: Context) -> Text:
        return (await self.process_batch([text], [ctx]))[0]

    async def process_batch(self, texts: list[Text], ctxs: list[Context]) -> list[Text]:
        if any(t.value == "hold" for t in texts):
            marker = Path(os.environ["STEP_MARKER"])
            await asyncio.to_thread(marker.write_text, f"running {len(texts)}")
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                step = time.perf_counter() + 0.01
                while time.perf_counter() < step:  # a step of compute, holding the loop
                    pass
                for ctx in ctxs:
                    await ctx.checkpoint()  # a loop turn only when something came meanwhile
        return [Text(f"{t.value.upper()}#{len(texts)}") for t in texts]


class SyncBatch(Stage):
    """A process_batch that is not a coroutine function: refused when the pipeline builds."""

    async def process(self, text: Text, ctx: Context) -> Text:
        return text

    def process_batch(self, texts: list[Text], ctxs: list[Context]) -> list[Text]:
        return texts


class GeneratorBatch(Stage):
    """A process_batch that returns a generator instead of a list."""

    async def process(self, text: Text, ctx: Context) -> Text:
        return text

    async def process_batch(self, texts: list[Text], ctxs: list[Context]) -> Any:
        return (t for t in texts)


class SwallowsCancel(Stage):
    """Joins the words of its stream; cancelled, it swallows the cancellation, tries to read
    on and returns what it has anyway, as a careless handler might."""

    async def process(self, tokens: Stream[Token], ctx: Context) -> Text:
        words: list[str] = []
        try:
            async for token in tokens:
                words.append(token.value)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                async for token in tokens:
                    words.append(token.value)
        return Text(" ".join(words))


class Sides(Outputs):
    """A token for each of two downstream stages."""

    left: Token | None = None
    right: Token | None = None


class ToBothSides(Stage):
    """Streams ``int(text)`` tokens to 'left' and to 'right', one after the other."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Sides]:
        for i in range(int(text.value)):
            yield Sides(left=Token(i, f"l{i}"), right=Token(i, f"r{i}"))


class ToRightOnly(Stage):
    """Streams ``int(text)`` tokens to 'right' alone: 'left' gets its stream's end only."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Sides]:
        for i in range(int(text.value)):
            yield Sides(right=Token(i, f"r{i}"))


class LeftThenRight(Stage):
    """Reads its 'left' stream to its end, then its 'right' one: with both fed by one
    producer in turn, streams longer than a window cannot complete."""

    async def process(self, left: Stream[Token], right: Stream[Token], ctx: Context) -> Text:
        lefts = [t.value async for t in left]
        rights = [t.value async for t in right]
        return Text(f"{len(lefts)}/{len(rights)}")


class ExplodingParams(Stage):
    """Its Params validator raises something other than a validation error."""

    class Params(BaseModel):
        size: int = 1

        @field_validator("size")
        @classmethod
        def _explode(cls, value: int) -> int:
            raise RuntimeError("validator exploded")

    async def process(self, text: Text, ctx: Context) -> Text:
        return text


class EchoWhenToldIfWaiting(Stage):
    """Returns its input; one beginning with 'wait' only once a line comes through the FIFO
    named by LINGER_FIFO."""

    async def process(self, text: Text, ctx: Context) -> Text:
        if text.value.startswith("wait"):
            await _line_through_fifo()
        return text


class OneThenStream(Stage):
    """Joins one chunk from 'a' and a stream from 'b': returns a's text and b's length."""

    async def process(self, a: Text, b: Stream[Token], ctx: Context) -> Text:
        n = 0
        async for _ in b:
            n += 1
        return Text(f"{len(a.value.split())}/{n}")


class StreamThenStream(Stage):
    """Joins two streams, 'a' (read first, to its end) and 'b': returns both lengths."""

    async def process(self, a: Stream[Text], b: Stream[Token], ctx: Context) -> Text:
        words = sum([len(t.value.split()) async for t in a])
        n = 0
        async for _ in b:
            n += 1
        return Text(f"{words}/{n}")


#: How long LateTokens waits before it streams, and how long each step of _slot_work takes.
LATE_S = 0.3
SLOT_WORK_S = 0.1
#: The turns in which TimesItsFirstRead waits for its stream's first chunk.
FIRST_READ_S = 0.05
#: The requests of this process in _slot_work now, and the most there were at once.
_WORKING: set[str] = set()
_PEAK = [0]


async def _slot_work(request_id: str) -> int:
    """Work that ``max_concurrency`` bounds; the most requests that did it at once so far."""
    _WORKING.add(request_id)
    _PEAK[0] = max(_PEAK[0], len(_WORKING))
    try:
        await asyncio.sleep(SLOT_WORK_S)
    finally:
        _WORKING.discard(request_id)
    return _PEAK[0]


class LateTokens(Stage):
    """Streams the words of a text, LATE_S after it came."""

    async def process(self, text: Text, ctx: Context) -> AsyncIterator[Token]:
        await asyncio.sleep(LATE_S)
        for i, word in enumerate(text.value.split()):
            yield Token(i, word)


class TimesItsFirstRead(Stage):
    """Joins a's text and b's stream: waits for b's first token in turns of its own timeout,
    reads the rest, then works; returns the stream's length and the most requests that
    worked here at once."""

    async def process(self, a: Text, b: Stream[Token], ctx: Context) -> Text:
        tokens = aiter(b)
        while True:
            try:
                async with asyncio.timeout(FIRST_READ_S):
                    await anext(tokens)
                break
            except TimeoutError:
                continue
        n = 1 + len([t async for t in tokens])
        peak = await _slot_work(ctx.request_id)
        return Text(f"{n} peak {peak}")


class ReadsBoth(Stage):
    """Reads streams a and b at once (``gather``), working on each chunk; returns both
    lengths and the most requests that worked here at once."""

    async def process(self, a: Stream[Token], b: Stream[Token], ctx: Context) -> Text:
        peak = 0

        async def eat(tokens: Stream[Token]) -> int:
            nonlocal peak
            n = 0
            async for _ in tokens:
                n += 1
                peak = await _slot_work(ctx.request_id)
            return n

        na, nb = await asyncio.gather(eat(a), eat(b))
        return Text(f"{na}/{nb} peak {peak}")


_READERS: set[asyncio.Future[Token]] = set()


class LeavesAReader(Stage):
    """Starts a task reading b's first token, reads a's stream, and returns its length
    without waiting for that task (which the request's end ends)."""

    async def process(self, a: Stream[Token], b: Stream[Token], ctx: Context) -> Text:
        reader = asyncio.ensure_future(anext(aiter(b)))
        _READERS.add(reader)  # (the loop keeps only a weak reference to a task)
        reader.add_done_callback(_READERS.discard)
        reader.add_done_callback(lambda task: task.cancelled() or task.exception())
        n = len([t async for t in a])
        return Text(str(n))


class SaysWhatItLoaded(Stage):
    """Answers with those of the comma-separated module names it is sent that its process
    has loaded; 'import NAME' imports NAME first and answers with its module's name."""

    async def process(self, text: Text, ctx: Context) -> Text:
        if text.value.startswith("import "):
            return Text(importlib.import_module(text.value.removeprefix("import ")).__name__)
        return Text(",".join(m for m in text.value.split(",") if m in sys.modules))
