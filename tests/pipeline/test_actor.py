"""One stage actor driven in this process: its own failure paths, where a pipeline of
real processes cannot reach them on demand."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import zmq

from pipeline._actor import StageActor
from pipeline._channel import OutputChannel, SendTarget
from pipeline._messages import FailureInfo, Peer, encode_batch
from pipeline._signature import PipelinePlan, build_plan
from pipeline._sockets import Outbox
from stages.text import Text
from tests.pipeline.conftest import spec, wait_for


def _echo_actor(
    plan: PipelinePlan,
    send: Callable[[str, Any], None],
    report: Callable[[FailureInfo], None],
    outbox: Outbox | None = None,
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
        outbox=outbox,
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


@pytest.mark.parametrize("transport", ["inline", "shm"])
async def test_a_request_is_released_once_what_it_sent_has_left_and_nothing_waits_here(
    transport: str,
) -> None:
    """A replica tells the master (through its heartbeat's ``take_released``) that it is done
    with a request only when its handler ended and the envelopes it sent have left the
    process, and never when a payload waits in this process to be read (shm)."""
    zctx: zmq.Context[Any] = zmq.Context()
    outbox = Outbox(zctx)
    # The edge under test is echo -> next: edges to and from the client are always inline.
    plan = build_plan(
        spec({"echo": ":Echo", "next": ":Echo"}, [("echo", "next")], transport=transport)
    )
    stage = plan.stages["echo"]
    reported: list[FailureInfo] = []
    actor = _echo_actor(plan, outbox.send, reported.append, outbox)
    peers = {"echo": {0: Peer("inproc://echo", "h")}, "next": {0: Peer("inproc://next", "h")}}
    actor.set_peers(peers, Peer("inproc://client", "h"))
    sent: list[Any] = []
    client = OutputChannel(
        stage.inputs["text"], host="h", endpoint="inproc://client", send=lambda _, r: sent.append(r)
    )
    try:
        actor.admit("r1", {"echo": 0, "next": 0})
        await client.send(
            "r1", client.codec.encode(Text("hi")), True, SendTarget("inproc://echo", "h")
        )
        (run,) = sent
        loop = asyncio.get_running_loop()
        before: asyncio.Future[tuple[int, bool, list[str]]] = loop.create_future()

        def read() -> None:  # as a socket reader calls it, but with no flush after it
            actor.on_data([encode_batch([run.seal()])])
            before.set_result((actor.inflight, outbox.pending, actor.take_released()))

        loop.call_soon(read)
        inflight, pending, released = await asyncio.wait_for(before, 5)
        if transport == "inline":
            # The handler ended within the read, its output queued, not yet sent.
            assert (inflight, pending, released) == (0, True, []), reported
        else:
            assert released == []  # an shm put waits for the loop: the handler runs on
        await wait_for(lambda: not actor.inflight, 5)
        assert actor.counts["completed"] == 1, reported
        outbox.flush()
        assert actor.take_released() == (["r1"] if transport == "inline" else [])
        assert actor.take_released() == []
    finally:
        await client.aclose()
        await actor.aclose()
        outbox.close()
        zctx.term()
