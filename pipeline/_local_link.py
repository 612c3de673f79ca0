"""Same-host data links: Unix stream sockets driven straight from the event loop.

ZMQ moves every message through an I/O thread on each side, so one hop between two
processes wakes three threads: the sender's I/O thread, the receiver's, then the receiver's
event loop. Between processes of one host the data plane uses a Unix stream socket instead,
which the receiver's loop reads itself: one wake-up per hop.

Each process that receives data listens on a socket in the abstract namespace, so there is no
file to leave behind: the name vanishes with its process, ``kill -9`` included. Its address
travels in ``Register`` and ``Peer`` beside the ZMQ endpoint, which stays the data endpoint's
identity (credit is addressed to it) and the path to other hosts. A link that cannot be
opened or breaks falls back to ZMQ, and the receiver treats both alike: every frame is a batch
of envelopes, and keys and credits do not depend on the order in which batches arrive.

On the wire a frame is its length (4 bytes, big-endian) followed by its bytes.

An abstract socket has no file, so no file permission guards it: the listener checks each
connecting process's credentials (``SO_PEERCRED``) and accepts only this user's and root's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
from collections import deque
from collections.abc import Callable

import structlog

from pipeline._logging import count_dropped

__all__ = ("LocalLink", "LocalListener", "local_links_enabled")

log = structlog.get_logger("stagewire.local_link")

_LENGTH = struct.Struct("!I")
#: Bytes asked of the kernel per read.
_READ_SIZE = 1 << 18
#: Frames at least this large are read straight into their own buffer, not via the stream's.
_DIRECT = 1 << 20
_PREFIX = "stagewire-"


def local_links_enabled() -> bool:
    """Whether same-host links are used: ``STAGEWIRE_LOCAL_LINKS=0`` sends everything by ZMQ."""
    return os.environ.get("STAGEWIRE_LOCAL_LINKS", "1") != "0"


def _abstract(address: str) -> str:
    """The socket name of an address: abstract-namespace names start with a NUL byte."""
    return "\0" + address


class LocalLink:
    """The sending end of one same-host link: frames queue when the socket is full.

    Nothing is dropped while the link is up; the receiver's credit windows bound what can
    queue. A broken link (the receiver died) drops what was queued, as ZMQ does for a
    departed peer with a linger of 0.

    Raises:
        OSError: from the constructor, when nothing listens at ``address``.
    """

    __slots__ = ("_loop", "_queue", "_sock", "_writing", "address", "broken")

    def __init__(self, address: str) -> None:
        self.address = address
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(_abstract(address))
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._queue: deque[memoryview] = deque()
        self._writing = False
        self.broken = False

    def send(self, frame: bytes) -> bool:
        """Send or queue one frame; False when the link is broken (nothing was sent)."""
        if self.broken:
            return False
        header = _LENGTH.pack(len(frame))
        if self._queue:
            self._queue.append(memoryview(header))
            self._queue.append(memoryview(frame))
            return True
        try:
            sent = self._sock.sendmsg((header, frame))
        except BlockingIOError:
            sent = 0
        except OSError:
            self._break()
            return False
        total = len(header) + len(frame)
        if sent < total:
            if sent < len(header):
                self._queue.append(memoryview(header)[sent:])
                self._queue.append(memoryview(frame))
            else:
                self._queue.append(memoryview(frame)[sent - len(header) :])
            self._start_writing()
        return True

    def _start_writing(self) -> None:
        if not self._writing:
            self._writing = True
            self._loop.add_writer(self._sock.fileno(), self._drain)

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            head = queue[0]
            try:
                sent = self._sock.send(head)
            except BlockingIOError:
                return
            except OSError:
                self._break()
                return
            if sent < len(head):
                queue[0] = head[sent:]
                return
            queue.popleft()
        self._writing = False
        self._loop.remove_writer(self._sock.fileno())

    def _break(self) -> None:
        if not self.broken:
            log.info("local_link_broken", address=self.address, dropped=len(self._queue) // 2)
        self.broken = True
        self.close()

    def close(self) -> None:
        """Close the link, dropping anything still queued; idempotent."""
        self._queue.clear()
        if self._writing:
            self._writing = False
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_writer(self._sock.fileno())
        self._sock.close()


class _Inbound:
    """One accepted connection: reads frames and hands each to the listener's callback.

    Reads go into one buffer kept for the connection's life, and frames are parsed from it
    in place: a read allocates nothing, and only a frame cut by the end of a read is copied
    aside (into ``_rest``) to wait for its tail.
    """

    __slots__ = ("_frame", "_got", "_listener", "_rbuf", "_rest", "sock")

    def __init__(self, sock: socket.socket, listener: LocalListener) -> None:
        self.sock = sock
        self._listener = listener
        self._rbuf = bytearray(_READ_SIZE)
        #: The start of a frame that the last read cut short.
        self._rest = bytearray()
        #: A large frame being read straight into its own buffer, and how much of it is in.
        self._frame: bytearray | None = None
        self._got = 0

    def on_readable(self) -> None:
        listener = self._listener
        rbuf = self._rbuf
        # A bounded amount per wake-up keeps one busy sender from starving the loop.
        for _ in range(64):
            if self._frame is not None:
                if not self._read_direct():
                    return
                continue
            try:
                n = self.sock.recv_into(rbuf)
            except BlockingIOError:
                return
            except OSError:
                listener.drop(self)
                return
            if not n:
                listener.drop(self)
                return
            if self._rest:
                self._rest += memoryview(rbuf)[:n]
                if not self._parse(self._rest, len(self._rest)):
                    return
            elif not self._parse(rbuf, n):
                return
            if n < len(rbuf):
                # The socket is drained (a short read): readiness is level-triggered, so the
                # loop calls again when more comes, and no read is wasted on EAGAIN.
                return

    def _read_direct(self) -> bool:
        """Read into the pending large frame; True when progress can continue."""
        frame = self._frame
        assert frame is not None
        try:
            with memoryview(frame) as view:
                n = self.sock.recv_into(view[self._got :])
        except BlockingIOError:
            return False
        except OSError:
            self._listener.drop(self)
            return False
        if n == 0:
            self._listener.drop(self)
            return False
        self._got += n
        if self._got == len(frame):
            self._frame = None
            self._listener.deliver(frame, self)
        return True

    def _parse(self, buf: bytearray, size: int) -> bool:
        """Deliver every complete frame in ``buf[:size]`` and keep what is left of it.

        A cut frame's start goes to ``_rest``, or, for a large frame, to its own buffer.
        False if the link was dropped.
        """
        off = 0
        listener = self._listener
        with memoryview(buf) as view:
            while size - off >= _LENGTH.size:
                (n,) = _LENGTH.unpack_from(buf, off)
                if n > listener.max_message:
                    listener.garbage(f"a frame of {n} bytes is over the limit")
                    listener.drop(self)
                    return False
                start = off + _LENGTH.size
                if size - start < n:
                    if n >= _DIRECT:
                        # Read the rest of a large frame into its own buffer: no second copy.
                        frame = bytearray(n)
                        have = size - start
                        frame[:have] = view[start:size]
                        self._frame, self._got = frame, have
                        off = size
                    break
                frame_bytes = bytes(view[start : start + n])
                off = start + n
                if not listener.deliver(frame_bytes, self):
                    return False
            rest = bytes(view[off:size])
        if buf is self._rest:
            del buf[:]
        # What is left is less than a frame, so at most one copy of a frame's start.
        self._rest += rest
        return True

    def close(self) -> None:
        self.sock.close()


_UCRED = struct.Struct("3i")


def _peer_uid(conn: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _pid, uid, _gid = _UCRED.unpack(creds)
    return int(uid)


class LocalListener:
    """Accepts same-host links and hands every frame received on them to a callback.

    The callback (given to :meth:`start`) receives a one-element list holding the frame,
    as ZMQ readers hand over the frames of one message; its exceptions go to ``on_error``,
    as for :class:`~pipeline._sockets.SocketReader`.

    Attributes:
        address: the name peers connect to (in the abstract namespace: no file).
        max_message: the largest frame accepted, in bytes; a larger one drops its link.
    """

    def __init__(
        self,
        on_error: Callable[[BaseException, list[bytes]], None],
        *,
        max_message: int,
    ) -> None:
        self._on_message: Callable[[list[bytes]], None] | None = None
        self._on_error = on_error
        self.max_message = max_message
        self.address = f"{_PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        sock = socket.socket(
            socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
        )
        sock.bind(_abstract(self.address))
        sock.listen(64)
        self._sock = sock
        self._inbound: dict[int, _Inbound] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.garbage_count = 0
        #: Frames received, over every link.
        self.frames = 0
        #: Connections refused: from a process of another user.
        self.refused = 0

    def start(self, on_message: Callable[[list[bytes]], None]) -> None:
        """Accept links and hand every frame read on them to ``on_message``.

        Until then, peers that connect wait in the backlog and what they write waits in
        their sockets: a worker binds at start-up (its address goes in ``Register``) but
        reads only once its stage is set up.
        """
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        assert self._loop is not None
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                log.warning("local_accept_failed", error=repr(exc))
                return
            # The socket's name is in the abstract namespace, which file permissions do not
            # guard: any local user could connect. Only this user's processes (or root's)
            # may send here.
            uid = _peer_uid(conn)
            if uid not in (os.geteuid(), 0):
                self.refused += 1
                log.warning("local_peer_refused", uid=uid, refused=self.refused)
                conn.close()
                continue
            conn.setblocking(False)
            inbound = _Inbound(conn, self)
            self._inbound[conn.fileno()] = inbound
            self._loop.add_reader(conn.fileno(), inbound.on_readable)

    def deliver(self, frame: bytes | bytearray, inbound: _Inbound) -> bool:
        """Hand one frame to the callback; False if the callback closed the listener."""
        self.frames += 1
        frames = [frame]
        assert self._on_message is not None  # set by start(), before any link is read
        try:
            self._on_message(frames)  # type: ignore[arg-type]  # a bytearray reads like bytes
        except Exception as exc:
            with contextlib.suppress(Exception):
                self._on_error(exc, frames)  # type: ignore[arg-type]
        return self._loop is not None

    def garbage(self, why: str) -> None:
        """Count a malformed frame (logged as the count passes 1, 10, 100, ...)."""
        self.garbage_count = count_dropped(log, "local_frame_dropped", self.garbage_count, why=why)

    def drop(self, inbound: _Inbound) -> None:
        """Stop reading a link that closed or broke."""
        fd = inbound.sock.fileno()
        if self._inbound.pop(fd, None) is not None and self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(fd)
        inbound.close()

    def close(self) -> None:
        """Stop accepting and close every link; idempotent."""
        loop, self._loop = self._loop, None
        for inbound in list(self._inbound.values()):
            fd = inbound.sock.fileno()
            if loop is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(fd)
            inbound.close()
        self._inbound.clear()
        if loop is not None:
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(self._sock.fileno())
        self._sock.close()
