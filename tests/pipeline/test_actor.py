"""One stage actor driven in this process: its own failure paths, where a pipeline of
real processes cannot reach them on demand."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pipeline._actor import StageActor
from pipeline._channel import OutputChannel, SendTarget
from pipeline._messages import Chunks, FailureInfo, Peer, encode_batch
from pipeline._signature import PipelinePlan, build_plan
from stages.text import Text
from tests.pipeline.conftest import spec, wait_for


def _echo_actor(
    plan: PipelinePlan,
    send: Callable[[str, Any], None],
    report: Callable[[FailureInfo], None],
) -> StageActor:
    """The actor of replica 0 of ``plan``'s stage ``echo``, at ``inproc://echo``."""
    stage = plan.stages["echo"]
    instance = stage.signature.cls(
        params=stage.params, name="echo", replica=0, device=stage.spec.device
    )
    return StageActor(
        stage,
        instance,
        replica=0,
        host="h",
        endpoint="inproc://echo",
        send=send,
        report_failure=report,
    )


def _echo(
    sent: list[Any], report: Callable[[FailureInfo], None]
) -> tuple[StageActor, OutputChannel]:
    """An Echo replica's actor, and a client's channel into it; both send into ``sent``."""
    plan = build_plan(spec({"echo": ":Echo"}, []))
    stage = plan.stages["echo"]
    actor = _echo_actor(plan, lambda _endpoint, msg: sent.append(msg), report)
    client = OutputChannel(
        stage.inputs["text"],
        host="h",
        endpoint="inproc://client",
        send=lambda _, run: sent.append(run),
    )
    return actor, client


async def test_a_failure_the_master_cannot_be_told_of_still_ends_the_request_here() -> None:
    """When reporting a handler's failure raises (the control socket is full: the master is
    unreachable), the replica still forgets the request instead of holding it for good."""
    reported: list[FailureInfo] = []

    def report(info: FailureInfo) -> None:
        reported.append(info)
        raise OSError("the control socket is full")  # as zmq.Again would

    sent: list[Any] = []
    actor, client = _echo(sent, report)
    try:
        actor.admit("r1", {"echo": 0})
        encoded = client.codec.encode(Text("boom"))
        assert client.try_send("r1", encoded, True, SendTarget("inproc://echo", "h"))
        (run,) = sent
        actor.on_data([encode_batch([run.seal()])])
        # The handler's task runs on the loop; nothing to wait on but its effect.
        await wait_for(lambda: not actor.inflight, 5)
        assert len(reported) == 1 and "boom" in str(reported[0])
        assert actor.counts["failed"] == 1
    finally:
        await client.aclose()
        await actor.aclose()


async def test_a_failure_whose_report_cannot_be_encoded_is_reported_by_a_stand_in() -> None:
    """When the failure's report itself has no encoding (a value msgspec refuses), a
    stand-in naming the error's type is reported, so the client's request fails instead of
    waiting for ever; a socket that refused the report gets no second one (see above)."""
    reported: list[FailureInfo] = []

    def report(info: FailureInfo) -> None:
        reported.append(info)
        if len(reported) == 1:
            raise UnicodeEncodeError("utf-8", "\udce9", 0, 1, "surrogates not allowed")

    sent: list[Any] = []
    actor, client = _echo(sent, report)
    try:
        actor.admit("r1", {"echo": 0})
        assert client.try_send(
            "r1", client.codec.encode(Text("boom")), True, SendTarget("inproc://echo", "h")
        )
        (run,) = sent
        actor.on_data([encode_batch([run.seal()])])
        await wait_for(lambda: not actor.inflight, 5)
        assert len(reported) == 2, reported
        assert reported[1].request_id == "r1"
        assert (
            reported[1].message == "ValueError (its report could not be sent: UnicodeEncodeError)"
        )
    finally:
        await client.aclose()
        await actor.aclose()


async def test_a_message_that_readies_a_handler_runs_it_before_the_reader_returns() -> None:
    """A one-chunk request's handler completes inside the callback that filed its chunk:
    its output is queued before that callback returns, with no loop turn between."""
    sent: list[Any] = []
    reported: list[FailureInfo] = []
    actor, client = _echo(sent, reported.append)
    actor.set_peers({"echo": {0: Peer("inproc://echo", "h")}}, Peer("inproc://client", "h"))
    loop = asyncio.get_running_loop()
    done: asyncio.Future[tuple[int, int]] = loop.create_future()
    try:
        actor.admit("r1", {"echo": 0})
        encoded = client.codec.encode(Text("hi"))
        assert client.try_send("r1", encoded, True, SendTarget("inproc://echo", "h"))
        (run,) = sent

        def read() -> None:  # as a socket reader calls it: a loop callback, not a task
            actor.on_data([encode_batch([run.seal()])])
            done.set_result((len(sent), actor.inflight))

        loop.call_soon(read)
        queued, inflight = await asyncio.wait_for(done, 5)
        assert actor.counts["failed"] == 0, reported
        assert (queued, inflight) == (2, 0)  # the echo's output is out, the request ended
        assert actor.counts["completed"] == 1
    finally:
        await client.aclose()
        await actor.aclose()


PLUGIN = "tests.transports.plugin_transport:EchoTransport"


@pytest.mark.parametrize("transport", ["inline", "shm", "plugin"])
async def test_a_replica_reports_its_ended_and_drained_requests(
    transport: str, tmp_path: Path
) -> None:
    """The heartbeat thread's ``take_reports``: a request is drained here once every payload
    of it is here (inline: on arrival; shm: once the handler got it), and ended once its
    handler ended, unless it sent a payload by a transport that does not declare
    ``survives_producer`` (the plug-in), which only this process's own end may free; nor is
    a request drained whose payload came by such a transport."""
    edge: Any = transport
    if transport == "plugin":
        edge = {"kind": PLUGIN, "options": {"directory": str(tmp_path), "capacity": 2**20}}
    stages = {"up": ":Echo", "echo": {"impl": ":Echo", "max_concurrency": 1}, "next": ":Echo"}
    plan = build_plan(spec(stages, [("up", "echo"), ("echo", "next")], transport=edge))
    reported: list[FailureInfo] = []
    sent: list[Any] = []
    actor = _echo_actor(plan, lambda _endpoint, msg: sent.append(msg), reported.append)
    peers = {name: {0: Peer(f"inproc://{name}", "h")} for name in ("up", "echo", "next")}
    actor.set_peers(peers, Peer("inproc://client", "h"))
    up = OutputChannel(
        plan.stages["up"].outputs["echo"],
        host="h",
        endpoint="inproc://up",
        send=lambda _, r: sent.append(r),
    )
    try:
        actor.admit("r1", {"up": 0, "echo": 0, "next": 0})
        encoded = up.codec.encode(Text("hi"))
        await up.send("r1", encoded, True, SendTarget("inproc://echo", "h"))
        run = sent.pop()
        assert actor.take_reports() == ([], [])
        # The replica's only handler slot is taken: the chunk arrives, and waits unread.
        async with actor._sem:
            actor.on_data([encode_batch([run.seal()])])
            # Its handler has started and waits for the slot: it could take the chunk.
            await wait_for(lambda: bool(actor._sem._waiters), 5, interval=0)
            assert actor.inflight == 1
            assert actor.take_reports() == ([], [("r1", "up")] if transport == "inline" else [])
        await wait_for(lambda: not actor.inflight, 5)
        assert actor.counts["completed"] == 1, reported
        if transport == "plugin":
            # Neither end of the plug-in's edge is ever told: its payloads may need the
            # producer's process even once got.
            assert actor.take_reports() == ([], [])
        else:
            drained = [] if transport == "inline" else [("r1", "up")]
            assert actor.take_reports() == (["r1"], drained)
        assert actor.take_reports() == ([], [])
    finally:
        await up.aclose()
        await actor.aclose()


async def test_chunks_that_cannot_be_read_fail_their_request_at_once() -> None:
    """A run whose descriptors its transport cannot read (a producer of another version, a
    plug-in's bug) fails its admitted request with a TransportError naming the edge and the
    producer, instead of dropping the run and leaving the request to a ChunkGap after the
    chunk timeout. So does one that comes before its request's Admit, once the Admit comes;
    one for a request that never comes is only counted as garbage."""
    stages = {"up": ":Echo", "echo": ":Echo"}
    plan = build_plan(spec(stages, [("up", "echo")], transport="shm", chunk_timeout="60s"))
    reported: list[FailureInfo] = []
    actor = _echo_actor(plan, lambda _endpoint, _msg: None, reported.append)
    actor.set_peers(
        {name: {0: Peer(f"inproc://{name}", "h")} for name in stages}, Peer("inproc://c", "h")
    )
    spoilt = msgspec.Raw(msgspec.msgpack.encode([{"t": "shm", "segment": 7}]))

    def run(rid: str) -> bytes:
        msg = Chunks(rid, "up->echo", 0, True, "shm", spoilt, "inproc://up", "h", 0)
        return encode_batch([msgspec.msgpack.encode(msg)])

    try:
        actor.admit("r1", {"up": 0, "echo": 0})
        actor.on_data([run("r1"), run("stranger")])
        assert len(reported) == 1, reported
        assert reported[0].request_id == "r1"
        assert "up->echo" in str(reported[0]) and "inproc://up" in str(reported[0])
        assert actor.counts["failed"] == 1 and actor.counts["garbage"] == 2
        assert actor.inflight == 0
        # Before its Admit: the request fails as it is admitted, not at its chunk timeout.
        actor.on_data([run("r2")])
        assert len(reported) == 1
        actor.admit("r2", {"up": 0, "echo": 0})
        assert [r.request_id for r in reported] == ["r1", "r2"]
        assert reported[1].kind == reported[0].kind and "up->echo" in str(reported[1])
        assert actor.inflight == 0 and actor.counts["failed"] == 2
    finally:
        await actor.aclose()


async def test_a_gone_replica_is_sent_nothing_of_its_requests_but_its_successor_is() -> None:
    """The replica of 'next' dies and restarts at another endpoint. Of the requests routed
    to that slot and not yet sent there, the one routed to the dead incarnation sends it
    nothing once the table without it comes (no Admit to the successor either); the one
    routed to the successor (its data came before the stale table did) is left alone, and
    sends to the successor once it is in the table."""
    stages = {"up": ":Echo", "echo": ":Echo", "next": ":Echo"}
    plan = build_plan(spec(stages, [("up", "echo"), ("echo", "next")]))
    actor = _echo_actor(plan, lambda _endpoint, _msg: None, lambda _info: None)
    peers = {name: {0: Peer(f"inproc://{name}", "h")} for name in stages}
    client = Peer("inproc://client", "h")
    actor.set_peers(peers, client)
    route = {"up": 0, "echo": 0, "next": 0}
    try:
        actor.admit("old", route, {"next": "inproc://next"})
        actor.admit("new", route, {"next": "inproc://next-2"})
        actor.set_peers({**peers, "next": {}})
        old, new = actor._requests["old"], actor._requests["new"]
        to_next = actor._outputs["next"]
        assert to_next.reader_stopped("old") and old.targets["next"].endpoint == "inproc://next"
        assert not to_next.reader_stopped("new") and "next" not in new.targets
        actor.set_peers({**peers, "next": {0: Peer("inproc://next-2", "h")}})
        assert (to_new := actor._target("next", new)) and to_new.endpoint == "inproc://next-2"
        assert (to_old := actor._target("next", old)) and to_old.endpoint == "inproc://next"
        assert to_next.reader_stopped("old") and not to_next.reader_stopped("new")
    finally:
        await actor.aclose()


class _Relay:
    """Replica 0 of 'echo' in up -> echo -> next, fed by an 'up' channel; what it sends is
    in ``sent`` as (endpoint, message), what it reports failed in ``reported``."""

    def __init__(self, **defaults: Any) -> None:
        stages = {"up": ":Echo", "echo": ":Echo", "next": ":Echo"}
        plan = build_plan(spec(stages, [("up", "echo"), ("echo", "next")], **defaults))
        self.sent: list[tuple[str, Any]] = []
        self.reported: list[FailureInfo] = []
        self.actor = _echo_actor(
            plan, lambda endpoint, msg: self.sent.append((endpoint, msg)), self.reported.append
        )
        self.peers = {name: {0: Peer(f"inproc://{name}", "h")} for name in stages}
        self.actor.set_peers(self.peers, Peer("inproc://client", "h"))
        self._runs: list[Any] = []
        self.up = OutputChannel(
            plan.stages["up"].outputs["echo"],
            host="h",
            endpoint="inproc://up",
            send=lambda _, run: self._runs.append(run),
        )

    def restart_next(self, endpoint: str) -> None:
        self.actor.set_peers({**self.peers, "next": {0: Peer(endpoint, "h")}})

    async def feed(self, rid: str, next_at: str) -> None:
        """Admit ``rid`` routed to the replica of 'next' at ``next_at``, and send it one chunk."""
        self.actor.admit(rid, {"up": 0, "echo": 0, "next": 0}, {"next": next_at})
        await self.up.send(rid, self.up.codec.encode(Text(rid)), True, SendTarget("", "h"))
        self.actor.on_data([encode_batch([self._runs.pop().seal()])])

    async def aclose(self) -> None:
        await self.up.aclose()
        await self.actor.aclose()


async def test_a_request_whose_data_comes_before_the_table_naming_its_replica_waits_for_it() -> (
    None
):
    """The replica of 'next' restarted at another endpoint, and a request routed to the new
    one comes before the master's table naming it (the two travel on different sockets):
    its handler waits for that table, then sends there, Admit first; nothing goes to the
    endpoint of the dead incarnation."""
    relay = _Relay()
    try:
        await relay.feed("r1", "inproc://next-2")
        await wait_for(lambda: relay.actor._table_changed is not None, 5, interval=0)
        assert relay.sent == [] and relay.actor.inflight == 1
        relay.restart_next("inproc://next-2")
        await wait_for(lambda: not relay.actor.inflight, 5)
        assert relay.reported == [] and relay.actor.counts["completed"] == 1
        assert [endpoint for endpoint, _ in relay.sent] == ["inproc://next-2"] * 2
    finally:
        await relay.aclose()


async def test_a_request_routed_to_a_replica_its_table_never_names_fails_at_the_chunk_timeout() -> (
    None
):
    """Should the table naming the request's replica never come, the request fails with
    StageUnavailable naming that replica once the edge's chunk timeout passed: no hang."""
    relay = _Relay(chunk_timeout="200ms")
    try:
        await relay.feed("r1", "inproc://next-2")
        await wait_for(lambda: bool(relay.reported), 5)
        (failure,) = relay.reported
        assert failure.kind == "unavailable" and failure.stage == "next"
        assert "inproc://next-2" in failure.message, failure
        assert relay.sent == [] and relay.actor.inflight == 0
    finally:
        await relay.aclose()


async def test_a_request_routed_to_a_replica_gone_before_its_data_came_waits_for_the_word() -> None:
    """A request routed to the incarnation of 'next' that the table here has already
    replaced sends nothing, to it or to its successor (no Admit there either), until the
    master says the request goes on without it (or aborts it). An endpoint alone cannot
    tell it from a new incarnation that bound the same port again: that one's request
    waits for the table naming it, and then sends there."""
    relay = _Relay()
    try:
        relay.restart_next("inproc://next-2")
        await relay.feed("r1", "inproc://next")
        await wait_for(lambda: relay.actor._table_changed is not None, 5, interval=0)
        assert relay.sent == [] and relay.actor.inflight == 1
        relay.actor.gone("r1", "next")
        await wait_for(lambda: not relay.actor.inflight, 5)
        assert relay.sent == [] and relay.reported == []
        # The port of the first incarnation, bound again by a third.
        await relay.feed("r2", "inproc://next")
        await wait_for(lambda: relay.actor._table_changed is not None, 5, interval=0)
        assert relay.sent == []
        relay.restart_next("inproc://next")
        await wait_for(lambda: not relay.actor.inflight, 5)
        assert [endpoint for endpoint, _ in relay.sent] == ["inproc://next"] * 2
        assert relay.reported == []
    finally:
        await relay.aclose()
