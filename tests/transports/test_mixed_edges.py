"""Properties of one edge on ``transport: auto`` whose chunks travel by a mix of transports,
checked against the real channel ends, the real transports and real descriptors.

The producer's :class:`OutputChannel` runs on an event loop of its own, in a thread, as a
stage process would; the consumer's :class:`InputChannel` runs on the test's loop. The
runs the producer sends are sealed and encoded as they would leave, and handed to the
consumer in an order, with repeats, that Hypothesis chooses, while the consumer reads the
chunks whose turn has come. Under a 4 KiB ``inline_threshold`` small chunks travel inline
and large ones by shm (both ends on host ``h1``) or by the network transport over loopback
(the consumer on host ``h2``), so one request's stream mixes two transports.

The design's contract (DESIGN.md, section 5): for any interleaving, duplication and
transport mix, the consumer sees 0..n exactly once and in order, and no descriptor is
leaked after completion, failure or abort.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import random
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import msgspec
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pipeline._channel import InputChannel, OutputChannel, SendTarget, file_run
from pipeline._channel import _background as release_tasks
from pipeline._errors import RequestAborted, TransportError
from pipeline._messages import Chunks, Credit, decode_batch, encode_batch
from pipeline._signature import EdgePlan, build_plan
from pipeline._stage import Stream
from tests.pipeline.conftest import spec, wait_for
from tests.pipeline.sample_stages import Blob

T = TypeVar("T")

#: The request every example streams.
RID = "r"
#: Payloads up to this size go inline; larger ones by shm or the network transport.
THRESHOLD = 4096
#: Chunks of data per example (the end of the stream comes after them, without payload).
MAX_CHUNKS = 24
#: Data sizes well below and well above the threshold (a Blob's encoding adds a few bytes).
#: MAX_CHUNKS of the largest fit the producer's 1 MiB shm arena together: nothing is
#: released before every chunk is put, and a full arena would send chunks inline instead.
SMALL = st.integers(0, 3000)
LARGE = st.integers(5000, 30_000)
#: Bounds on waits that succeed within milliseconds when nothing is wrong.
READ_TIMEOUT = 10.0
SETTLE_TIMEOUT = 10.0

#: ``h1``: both ends on one host (large chunks by shm); ``h2``: on two (by network).
HOSTS = pytest.mark.parametrize("host", ["h1", "h2"], ids=["inline+shm", "inline+network"])
PROPERTY = settings(max_examples=40, deadline=None, database=None)


def _plan() -> EdgePlan:
    """The flood->drain edge of Blobs on ``auto``, with a small shm arena."""
    s = spec(
        {"flood": ":Flood", "drain": ":Drain"},
        [("flood", "drain")],
        transport={"kind": "auto", "options": {"shm": {"capacity": "1MiB"}}},
        inline_threshold=f"{THRESHOLD}B",
    )
    return build_plan(s).stages["flood"].outputs["drain"]


def _payload(seq: int, size: int) -> bytes:
    """Chunk ``seq``'s data: bytes that differ from one chunk to the next."""
    return random.Random(seq).randbytes(size)


def _our_segments() -> set[str]:
    """The stagewire shared-memory objects (shm arenas, CUDA release tables) this process
    owns: their names carry its pid. Other processes' segments are not ours to judge."""
    mine = f"-{os.getpid()}-"
    return {n for n in os.listdir("/dev/shm") if n.startswith("stagewire-") and mine in n}


@dataclass(frozen=True, slots=True)
class Frame:
    """One run as it travels: the encoded envelope, and what it says."""

    data: bytes = field(repr=False)
    first: int
    count: int
    transport: str
    final: bool

    @property
    def seqs(self) -> range:
        return range(self.first, self.first + self.count)


def _frame(data: bytes) -> Frame:
    (run,) = decode_batch(data)
    assert isinstance(run, Chunks)
    count = len(msgspec.msgpack.decode(run.descriptors))
    return Frame(data, run.first, count, run.transport, run.final)


class Producer:
    """The producer's end of the edge on an event loop of its own, in a thread: a stage
    process of its own, which the test can also hold busy (see :meth:`busy`)."""

    def __init__(self, plan: EdgePlan, consumer_host: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="producer", daemon=True)
        self._pending: list[Any] = []  # runs sent and not yet sealed (producer thread only)
        self._target = SendTarget("consumer", consumer_host)
        self._thread.start()
        self._out: OutputChannel | None = None
        self._make = functools.partial(
            OutputChannel, plan, host="h1", endpoint="producer", send=self._sent
        )

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()
        self._loop.run_until_complete(self._loop.shutdown_default_executor())
        self._loop.close()

    def _sent(self, endpoint: str, run: Any) -> None:
        assert endpoint == "consumer"
        self._pending.append(run)

    @property
    def out(self) -> OutputChannel:
        """The channel end, to be touched only on the producer's loop."""
        assert self._out is not None
        return self._out

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn()`` on the producer's loop and wait for its result here."""

        async def run() -> T:
            return await fn()

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), self._loop))

    async def start(self) -> None:
        async def make() -> None:
            self._out = self._make()

        await self.call(make)

    async def produce(
        self, sizes: Sequence[int], start: int, stop: int, final: bool, flush: Sequence[bool]
    ) -> list[Frame]:
        """Send chunks ``start .. stop - 1`` (then the end, if ``final``) as a stage's
        output does; the runs leave as encoded frames after each chunk whose ``flush`` is
        set, as an outbox flushing its batch, and after the last."""

        async def produce() -> list[Frame]:
            out = self.out
            frames: list[Frame] = []
            for seq in range(start, stop):
                encoded = out.codec.encode(Blob(seq, _payload(seq, sizes[seq])))
                if not out.try_send(RID, encoded, False, self._target):
                    await out.send(RID, encoded, False, self._target)
                if flush[seq]:
                    frames += self._seal()
            if final:
                await out.send(RID, None, True, self._target)
            return frames + self._seal()

        return await self.call(produce)

    def _seal(self) -> list[Frame]:
        runs, self._pending = self._pending, []
        return [_frame(encode_batch([run.seal()])) for run in runs]

    def credit(self, credit: Credit) -> None:
        self._loop.call_soon_threadsafe(self.out.on_credit, credit)

    async def forget(self, reason: str | None) -> None:
        async def forget() -> None:
            self.out.forget(RID, reason)

        await self.call(forget)

    async def statistics(self) -> dict[str, Any]:
        async def statistics() -> dict[str, Any]:
            return {**self.out.statistics(), "open_windows": self.out.open_windows}

        return await self.call(statistics)

    async def held(self) -> dict[str, int]:
        """Payloads each transport still holds (shm: after taking back released ones)."""
        stats = await self.statistics()
        return {name: t["held"] for name, t in stats["transports"].items() if t["held"]}

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Hold the producer's loop, as a handler computing without an await would: while
        it is held the producer serves no network fetch (nor anything else)."""
        holding, release = threading.Event(), threading.Event()

        def hold() -> None:
            holding.set()
            release.wait(READ_TIMEOUT)

        self._loop.call_soon_threadsafe(hold)
        assert holding.wait(READ_TIMEOUT), "the producer's loop never came round"
        try:
            yield
        finally:
            release.set()

    async def aclose(self) -> None:
        """Close the channel end (its transports with it) and stop the thread."""
        if self._out is not None:
            await self.call(self._out.aclose)

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        await self.call(cancel_rest)
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, READ_TIMEOUT)
        assert not self._thread.is_alive()


class Consumer:
    """The consumer's end of the edge, reading one request as a handler's Stream does."""

    def __init__(self, plan: EdgePlan, host: str, sizes: Sequence[int]) -> None:
        self.credits: list[bytes] = []
        self.inp = InputChannel(plan, host=host, send=self._credit)
        self.inflow = self.inp.open(RID)
        self.stream: Stream[Blob] = Stream(
            functools.partial(self.inp.next, self.inflow),
            functools.partial(self.inp.poll, self.inflow),
        )
        self.sizes = sizes
        #: The seqs the handler read, in the order it read them.
        self.seen: list[int] = []
        #: The seqs delivered to the inflow so far (the end's included).
        self.delivered: set[int] = set()

    def _credit(self, sender: str, message: bytes | Any) -> None:
        assert sender == "producer"
        self.credits.append(message)

    def deliver(self, frame: Frame) -> None:
        """A run arrives while the request is open here: filed in its reorder buffer."""
        (run,) = decode_batch(frame.data)
        assert isinstance(run, Chunks)
        file_run(self.inflow, run, self.inp.admit(run))
        self.delivered.update(frame.seqs)

    def deliver_late(self, frame: Frame) -> None:
        """A run arrives after the request ended here: released unread, as a stage does
        with the runs of requests it has finished (``StageActor._on_run``)."""
        (run,) = decode_batch(frame.data)
        assert isinstance(run, Chunks)
        for item in self.inp.admit(run):
            self.inp.discard(item)

    def readable(self) -> int:
        """How many chunks of data the handler can read now without waiting."""
        n = 0
        while len(self.seen) + n in self.delivered and len(self.seen) + n < len(self.sizes):
            n += 1
        return n

    def check(self, blob: Blob) -> None:
        """A chunk the handler read must be the next one, whole."""
        assert isinstance(blob, Blob)
        assert blob.seq == len(self.seen), f"read seq {blob.seq} after {self.seen}"
        assert blob.data == _payload(blob.seq, self.sizes[blob.seq]), f"seq {blob.seq} damaged"
        self.seen.append(blob.seq)

    async def read(self) -> None:
        self.check(await asyncio.wait_for(anext(self.stream), READ_TIMEOUT))

    async def read_end(self) -> None:
        """The next read finds the end of the stream."""
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(anext(self.stream), READ_TIMEOUT)

    def forward_credits(self, producer: Producer) -> None:
        """The credits returned so far, to the producer, through their encoding."""
        credits, self.credits = self.credits, []
        for message in credits:
            (credit,) = decode_batch(encode_batch([message]))
            assert isinstance(credit, Credit)
            producer.credit(credit)

    def held(self) -> dict[str, int]:
        """What this end still holds: payloads per transport, release tasks under way, and
        chunks the request's buffer or reader keeps."""
        held = {
            name: recv.statistics().held
            for name, recv in self.inp._receivers.items()
            if recv.statistics().held
        }
        if release_tasks:
            held["releases under way"] = len(release_tasks)
        if self.inflow.buffer.buffered:
            held["buffered"] = self.inflow.buffer.buffered
        if self.inflow.held is not None or self.inflow.fetching is not None:
            held["being read"] = 1
        return held


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """What one example streams: each chunk's data size, and after which chunks the
    producer's outbox flushes its batch (a frame per run it holds)."""

    sizes: list[int]
    flush: list[bool]

    @property
    def large(self) -> int:
        return sum(n > THRESHOLD for n in self.sizes)


@st.composite
def streams(draw: st.DrawFn, with_large: bool = False) -> StreamPlan:
    """1 to MAX_CHUNKS chunks, each small or large (one large at least if ``with_large``),
    and a flush schedule."""
    sizes = draw(st.lists(st.one_of(SMALL, LARGE), min_size=1, max_size=MAX_CHUNKS))
    if with_large and not any(n > THRESHOLD for n in sizes):
        sizes[draw(st.integers(0, len(sizes) - 1))] = draw(LARGE)
    flush = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    return StreamPlan(sizes, flush)


def _arrivals(data: st.DataObject, frames: Sequence[Frame]) -> list[Frame]:
    """Every frame once, in an order Hypothesis chooses, with repeats of some anywhere
    (a repeat may come before its first arrival is due: the two are indistinguishable)."""
    order = [frames[i] for i in data.draw(st.permutations(range(len(frames))), label="order")]
    if not frames:
        return order
    repeats = data.draw(
        st.lists(st.integers(0, len(frames) - 1), max_size=len(frames)), label="repeats"
    )
    for i in repeats:
        order.insert(data.draw(st.integers(0, len(order)), label="at"), frames[i])
    return order


async def _deliver(
    data: st.DataObject, consumer: Consumer, producer: Producer, arrivals: Sequence[Frame]
) -> None:
    """Deliver ``arrivals`` in turn; before each, the handler reads as many of the chunks
    it could read as Hypothesis chooses, and the credits it returned go back."""
    for frame in arrivals:
        reads = data.draw(st.integers(0, 3), label="reads before the next arrival")
        for _ in range(min(reads, consumer.readable())):
            await consumer.read()
        consumer.forward_credits(producer)
        if frame.first < len(consumer.seen):
            event("a repeat came after its chunk was read")
        consumer.deliver(frame)


def _check_mix(stream: StreamPlan, stats: dict[str, Any], host: str) -> None:
    """The producer used the transports the example meant: inline for the small chunks,
    shm or network for the large ones, and never fell back."""
    large = "shm" if host == "h1" else "network"
    used = {name: n for name, n in stats["used"].items() if n}
    expected = {"inline": len(stream.sizes) - stream.large, large: stream.large}
    assert used == {name: n for name, n in expected.items() if n}
    assert stats["fallbacks"] == 0


async def _settled(producer: Producer, consumer: Consumer) -> None:
    """Wait until neither end holds anything, failing with what is still held."""
    held: dict[str, Any] = {}

    async def nothing_held() -> bool:
        held["producer"] = await producer.held()
        held["consumer"] = consumer.held()
        return not held["producer"] and not held["consumer"]

    try:
        await wait_for(nothing_held, SETTLE_TIMEOUT)
        return
    except TimeoutError:
        pass
    # Outside the handler, so the failure carries no context that varies from run to run
    # (where the timeout interrupted the wait), and Hypothesis sees the same failure again.
    pytest.fail(f"still held after {SETTLE_TIMEOUT}s: {held}")


def _run(
    host: str, scenario: Callable[[Producer, Consumer], Awaitable[None]], sizes: list[int]
) -> None:
    """Run one example on a fresh pair of channel ends, closed whatever happens; no
    shared-memory segment may outlive them."""
    before = _our_segments()

    async def main() -> None:
        plan = _plan()
        producer = Producer(plan, host)
        consumer = Consumer(plan, host, sizes)
        try:
            await producer.start()
            await scenario(producer, consumer)
        finally:
            await producer.aclose()
            await consumer.inp.aclose()

    asyncio.run(main())
    assert _our_segments() <= before, f"left behind: {_our_segments() - before}"


@HOSTS
@PROPERTY
@given(stream=streams(), data=st.data())
def test_any_arrival_order_and_repeats_deliver_each_chunk_once_in_order(
    host: str, stream: StreamPlan, data: st.DataObject
) -> None:
    """Whatever order the runs of a mixed stream arrive in, repeated or not, and however
    the handler's reads interleave with the arrivals, it reads chunks 0..n-1 once each,
    in order and whole, then the end; every repeat is counted as a duplicate."""
    n = len(stream.sizes)

    async def scenario(producer: Producer, consumer: Consumer) -> None:
        frames = await producer.produce(stream.sizes, 0, n, True, stream.flush)
        _check_mix(stream, await producer.statistics(), host)
        arrivals = _arrivals(data, frames)
        await _deliver(data, consumer, producer, arrivals)
        while consumer.readable():
            await consumer.read()
        await consumer.read_end()
        assert consumer.seen == list(range(n))
        repeats = sum(f.count for f in arrivals) - (n + 1)
        assert consumer.inflow.buffer.duplicates == repeats

    _run(host, scenario, stream.sizes)


@HOSTS
@PROPERTY
@given(stream=streams(), data=st.data())
def test_a_completed_request_leaves_no_descriptor_held(
    host: str, stream: StreamPlan, data: st.DataObject
) -> None:
    """Once a mixed stream was read to its end and the request completed at both ends,
    with repeats of its runs arriving before and after that, no transport holds a payload
    at either end: every fetch released its payload and every repeat was released
    unread, without spoiling the original."""
    n = len(stream.sizes)

    async def scenario(producer: Producer, consumer: Consumer) -> None:
        frames = await producer.produce(stream.sizes, 0, n, True, stream.flush)
        await _deliver(data, consumer, producer, _arrivals(data, frames))
        while consumer.readable():
            await consumer.read()
        await consumer.read_end()
        # The request completes: its state goes at both ends (StageActor.forget), and
        # repeats still travelling are late.
        consumer.inflow.end()
        for i in data.draw(st.lists(st.integers(0, len(frames) - 1)), label="late repeats"):
            consumer.deliver_late(frames[i])
        consumer.forward_credits(producer)
        await producer.forget(None)
        await _settled(producer, consumer)
        assert (await producer.statistics())["open_windows"] == 0
        assert consumer.seen == list(range(n))

    _run(host, scenario, stream.sizes)


async def _read_under_way(reading: asyncio.Future[Any], consumer: Consumer) -> None:
    """Let the loop run until ``reading`` is done or waits for its chunk's fetch (a step
    inside this loop, which no event announces: at most 100 turns)."""
    for _ in range(100):
        if reading.done() or consumer.inflow.fetching is not None:
            return
        await asyncio.sleep(0)  # one loop turn


@HOSTS
@PROPERTY
@given(stream=streams(with_large=True), data=st.data())
def test_a_repeat_arriving_while_its_chunk_is_fetched_loses_nothing(
    host: str, stream: StreamPlan, data: st.DataObject
) -> None:
    """A run that arrives a second time while the handler's read of its first chunk is
    still fetching the payload (the producer is busy and has not served it yet) is a
    duplicate like any other: the read returns that chunk whole, and the rest follow in
    order."""
    n = len(stream.sizes)

    async def scenario(producer: Producer, consumer: Consumer) -> None:
        frames = await producer.produce(stream.sizes, 0, n, True, stream.flush)
        carried = [f for f in frames if f.transport not in ("", "inline")]
        victim = data.draw(st.sampled_from(carried), label="repeated mid-fetch")
        others = [f for f in frames if f is not victim]
        await _deliver(data, consumer, producer, _arrivals(data, others))
        while consumer.readable():
            await consumer.read()
        assert len(consumer.seen) == victim.first
        with producer.busy():
            consumer.deliver(victim)
            reading = asyncio.ensure_future(anext(consumer.stream))
            await _read_under_way(reading, consumer)
            if host == "h2":  # a busy producer cannot have served the fetch
                assert not reading.done() and consumer.inflow.fetching is not None
            if not reading.done():
                event("the repeat came while the read was under way")
            consumer.deliver(victim)
            # Any release the repeat started has run (it starts none: it names the chunk
            # under fetch).
            await asyncio.wait_for(asyncio.gather(*release_tasks), READ_TIMEOUT)
        consumer.check(await asyncio.wait_for(reading, READ_TIMEOUT))
        while consumer.readable():
            await consumer.read()
        await consumer.read_end()
        assert consumer.seen == list(range(n))

    _run(host, scenario, stream.sizes)


Ending = Literal["aborted", "failed", "stopped"]


@HOSTS
@PROPERTY
@given(
    stream=streams(),
    ending=st.sampled_from(["aborted", "failed", "stopped"]),
    data=st.data(),
)
def test_a_request_ended_early_leaves_no_descriptor_held(
    host: str, stream: StreamPlan, ending: Ending, data: st.DataObject
) -> None:
    """A request that ends before its consumer read its stream to the end, whether
    aborted, failed, or because its handler returned early (and said it reads no more),
    leaves no payload held at either end once the runs still travelling have arrived:
    those buffered are released as the request ends at the consumer, a read under way
    then ends with the request (or returns its chunk whole), and late runs are released
    unread. The producer may have sent only part of its stream by then; it sends nothing
    more after an abort, and what it sends after the consumer stopped reading is dropped
    before any transport takes it."""
    n = len(stream.sizes)

    async def scenario(producer: Producer, consumer: Consumer) -> None:
        sent = data.draw(st.integers(0, n), label="chunks sent before the end")
        final = sent == n and data.draw(st.booleans(), label="end sent before the end")
        frames = await producer.produce(stream.sizes, 0, sent, final, stream.flush)
        arrivals = _arrivals(data, frames)
        cut = data.draw(st.integers(0, len(arrivals)), label="arrivals, producer free")
        busy_cut = data.draw(st.integers(cut, len(arrivals)), label="arrivals, producer busy")
        await _deliver(data, consumer, producer, arrivals[:cut])
        error: BaseException | None = {
            "aborted": RequestAborted(RID, "aborted by the client"),
            "failed": RuntimeError("the handler failed"),
            "stopped": None,
        }[ending]
        reading: asyncio.Future[Blob] | None = None
        with producer.busy():
            # What arrives now the producer cannot serve yet (network): a read waits for it.
            for frame in arrivals[cut:busy_cut]:
                consumer.deliver(frame)
            if consumer.readable() and data.draw(st.booleans(), label="a read under way"):
                reading = asyncio.ensure_future(anext(consumer.stream))
                await _read_under_way(reading, consumer)
                if not reading.done():
                    event(f"{ending} while a read was under way")
            # The request ends at the consumer, as StageActor.forget ends it.
            if error is None:
                consumer.inp.stop_reading(RID, consumer.inflow.sender)
            consumer.inflow.end(error)
        if reading is not None:
            # The read returns its chunk (it had it before the end), or ends with the request.
            await asyncio.wait([reading], timeout=READ_TIMEOUT)
            assert reading.done(), "the read under way never ended"
            if reading.exception() is None:
                consumer.check(reading.result())
            elif error is None:
                assert isinstance(reading.exception(), StopAsyncIteration)
            else:
                assert reading.exception() is error
        consumer.forward_credits(producer)
        late = list(arrivals[busy_cut:])
        if error is None:
            # The producer goes on; once it has heard that nothing more is read (the
            # consumer knows where to say it from the first run that reached it), what it
            # sends is dropped before any transport takes it.
            told = bool(consumer.inflow.sender)
            rest = await producer.produce(stream.sizes, sent, n, not final, stream.flush)
            if told:
                unread = (n - sent) + (not final)
                assert (rest, (await producer.statistics())["unread"]) == ([], unread)
            late += rest
            await producer.forget(None)
        else:
            # The request is aborted at the producer too: it sends nothing more.
            await producer.forget(str(error))
        if late:
            event(f"{ending} with runs still travelling")
        for frame in data.draw(st.permutations(late), label="late order"):
            consumer.deliver_late(frame)
        await _settled(producer, consumer)
        assert consumer.seen == list(range(len(consumer.seen)))

    _run(host, scenario, stream.sizes)


@HOSTS
def test_the_mix_is_real_and_nothing_is_left_in_dev_shm(host: str) -> None:
    """The harness itself: a stream alternating small and large chunks uses inline and shm
    on one host, inline and network across two, and closing both ends removes the shm
    arena."""
    plan = StreamPlan([100, 10_000] * 3, [True] * 6)
    carrier = "shm" if host == "h1" else "network"

    async def scenario(producer: Producer, consumer: Consumer) -> None:
        frames = await producer.produce(plan.sizes, 0, 6, True, plan.flush)
        assert [f.transport for f in frames] == ["inline", carrier] * 3 + [""]
        _check_mix(plan, await producer.statistics(), host)
        for frame in frames:
            consumer.deliver(frame)
        while consumer.readable():
            await consumer.read()
        await consumer.read_end()
        assert bool(_our_segments()) == (host == "h1")

    _run(host, scenario, plan.sizes)


def test_a_channel_closed_as_its_requests_end_gives_their_payloads_back() -> None:
    """A stage shutting down forgets every request (releasing what their buffers hold),
    then closes its channels at once (``StageActor.aclose``). The releases ran after the
    close, which ignored them: the producer's shm arena kept the extents while both
    processes lived. They now finish before the channel's transports close."""
    sizes = [10_000] * 3

    async def scenario(producer: Producer, consumer: Consumer) -> None:
        frames = await producer.produce(sizes, 0, len(sizes), True, [True] * len(sizes))
        for frame in frames:
            consumer.deliver(frame)
        assert await producer.held() == {"shm": len(sizes)}
        consumer.inflow.end(RequestAborted(RID, "stage shutting down"))
        await consumer.inp.aclose()
        # The extents are free once the producer looks (its next statistics or put).
        await wait_for(functools.partial(_held, producer, {}), SETTLE_TIMEOUT)

    _run("h1", scenario, sizes)


async def _held(producer: Producer, expected: dict[str, int]) -> bool:
    return await producer.held() == expected


def test_a_run_dropped_for_a_bad_descriptor_releases_the_good_ones() -> None:
    """A run whose descriptors parse only in part (corrupted, or forged) is dropped whole;
    what its valid descriptors name (here a network payload, which parsing starts fetching)
    is released at the consumer, not held for ever."""
    sizes = [20_000, 20_000]

    async def scenario(producer: Producer, consumer: Consumer) -> None:
        frames = await producer.produce(sizes, 0, 2, False, [False, False])
        (frame,) = [f for f in frames if f.count == 2]
        assert frame.transport == "network"
        (run,) = decode_batch(frame.data)
        assert isinstance(run, Chunks)
        good, _ = msgspec.msgpack.decode(run.descriptors, type=list[msgspec.Raw])
        forged = msgspec.msgpack.encode([good, b"not a descriptor"])
        with pytest.raises(TransportError, match="bad network descriptor"):
            consumer.inp.admit(msgspec.structs.replace(run, descriptors=msgspec.Raw(forged)))
        await wait_for(lambda: not consumer.held(), SETTLE_TIMEOUT)
        # The producer was told to drop the first; it keeps the second, whose descriptor
        # was spoilt on the way, until its own timer gives up on a reader.
        await wait_for(lambda: _held(producer, {"network": 1}), SETTLE_TIMEOUT)

    _run("h2", scenario, sizes)
