"""A loopback TCP proxy on a cleartext gRPC (HTTP/2) link that a test can stall right after a chosen message.

Why: a test that kills a server mid-response must know the response is not over when the kill lands. A
fast server (vLLM on the tiny model decodes thousands of tokens a second) can finish before a busy client
even reads the first message, so "kill when the first message arrives" is a race. The proxy removes it:
once the server has sent the chosen message on the watched call, nothing more from that server reaches the
client (it is read and dropped), so whatever the server produces after that message is lost with it when it
is killed, as on a host that went down.

`GateProxy(target, stall_after)` forwards every connection both ways, parsing HTTP/2 frame headers only.
`arm()`: the next stream a client opens (a HEADERS frame with a new stream id) is watched; the server's
DATA frames on it are split into gRPC messages, and after forwarding the frame that completes a message for
which `stall_after(message)` holds, the link stalls (`stalled` is set); with `hold_chosen` that frame is not
forwarded either (a server whose one answer must never arrive, e.g. a prefill worker's handoff). When the
server's end closes, the client's end is closed too. `disarm()`: watch nothing (a stream already watched is
released unless stalled). Arm only once the client's long-lived streams are open: the proxy tells calls
apart by order, not by path.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS = 0x0, 0x1
PADDED = 0x8
GRPC_PREFIX = 5  # compressed flag, 4-byte big-endian length


def _frames(sock: socket.socket, skip: bytes = b"") -> Callable[[], tuple[bytes, bytes] | None]:
    """A reader of whole frames from `sock` (after the `skip` preface): each call returns the next (frame,
    payload), or None at end of stream."""
    buf = bytearray()

    def fill(n: int) -> bool:
        while len(buf) < n:
            data = sock.recv(1 << 16)
            if not data:
                return False
            buf.extend(data)
        return True

    def next_frame() -> tuple[bytes, bytes] | None:
        if not fill(9):
            return None
        length = int.from_bytes(buf[:3], "big")
        if not fill(9 + length):
            return None
        frame = bytes(buf[: 9 + length])
        del buf[: 9 + length]
        return frame, frame[9:]

    if skip and (not fill(len(skip)) or bytes(buf[: len(skip)]) != skip):
        raise ConnectionError("not an HTTP/2 client preface")
    del buf[: len(skip)]
    return next_frame


class GateProxy:
    """See the module docstring."""

    def __init__(self, target: str, stall_after: Callable[[bytes], bool], hold_chosen: bool = False) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.stall_after = stall_after
        self.hold_chosen = hold_chosen  # the chosen message itself never reaches the client either
        self.stalled = threading.Event()
        self._lock = threading.Lock()
        self._armed = False
        self._watched: tuple[int, int] | None = None  # (connection number, stream id)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._server.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._closing = False
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self) -> None:
        with self._lock:
            self._armed, self._watched = True, None

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            if not self.stalled.is_set():
                self._watched = None

    def close(self) -> None:
        self._closing = True
        for s in [self._server, *self._sockets]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def _accept(self) -> None:
        n = 0
        while not self._closing:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            n += 1
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._sockets += [client, upstream]
            threading.Thread(target=self._client_to_server, args=(n, client, upstream), daemon=True).start()
            threading.Thread(target=self._server_to_client, args=(n, upstream, client), daemon=True).start()

    def _client_to_server(self, conn: int, client: socket.socket, upstream: socket.socket) -> None:
        highest = 0
        with _closing_both(client, upstream):
            next_frame = _frames(client, skip=PREFACE)
            upstream.sendall(PREFACE)
            while (got := next_frame()) is not None:
                frame, _ = got
                kind, stream = frame[3], int.from_bytes(frame[5:9], "big") & 0x7FFFFFFF
                if kind == HEADERS and stream > highest:
                    highest = stream
                    with self._lock:  # watched before the server can see the call, so before it can answer
                        if self._armed and self._watched is None:
                            self._watched = (conn, stream)
                upstream.sendall(frame)

    def _server_to_client(self, conn: int, upstream: socket.socket, client: socket.socket) -> None:
        pending = bytearray()  # the watched stream's gRPC bytes not yet a whole message
        with _closing_both(client, upstream):
            next_frame = _frames(upstream)
            while (got := next_frame()) is not None:
                frame, payload = got
                if self.stalled.is_set():
                    continue  # what the server sends after the chosen message never reaches the client
                kind, flags, stream = frame[3], frame[4], int.from_bytes(frame[5:9], "big") & 0x7FFFFFFF
                with self._lock:
                    watched = self._watched == (conn, stream)
                if not (watched and kind == DATA):
                    client.sendall(frame)
                    continue
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                pending += payload
                chosen = any(self.stall_after(m) for m in _messages(pending))
                if not (chosen and self.hold_chosen):
                    client.sendall(frame)
                if chosen:
                    self.stalled.set()


def _messages(pending: bytearray) -> list[bytes]:
    """The whole gRPC messages at the front of `pending`, removed from it."""
    out = []
    while len(pending) >= GRPC_PREFIX:
        size = int.from_bytes(pending[1:GRPC_PREFIX], "big")
        if len(pending) < GRPC_PREFIX + size:
            break
        out.append(bytes(pending[GRPC_PREFIX : GRPC_PREFIX + size]))
        del pending[: GRPC_PREFIX + size]
    return out


@contextlib.contextmanager
def _closing_both(a: socket.socket, b: socket.socket) -> Iterator[None]:
    """Either end failing or closing closes the other (a killed server closes the client's connection)."""
    try:
        yield
    except OSError:
        pass
    finally:
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
