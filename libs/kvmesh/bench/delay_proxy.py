"""A userspace TCP proxy: a link with added latency and a bandwidth cap where there is no `tc netem`.

    python -m kvmesh.bench.delay_proxy --target HOST:PORT [--delay-ms D] [--rate B] [--report-every N]
                                       [--drop-on-close] [--listen 127.0.0.1] [--port P]
                                       [--engine native|python]

Prints the port it listens on (one line; `--port`, default 0 = a free one: a proxy restarted on the port of
a killed one is the same link healed), then forwards every connection to the target, holding each
received chunk D ms before it is sent on, in both directions (the round trip grows by 2 D). `--rate` caps
each direction of each connection at B bytes/s; the proxy then holds at most `Link.hold_bytes` per direction
(64 KiB, or twice the bandwidth-delay product) and shrinks its sockets' receive buffers, so a fast sender
meets backpressure: what the link has not carried yet stays with the sender (and dies with it).
`--report-every N` prints `forwarded <bytes>` each time the bytes sent on from the target to the clients (all
connections) pass another multiple of N: a test can act on the real progress of a response stream instead
of sleeping. `--drop-on-close`: when one side closes, the bytes still queued for the other are dropped, not
delivered, and the other side is closed (a link whose end went down: a killed process's kernel would still
flush what it had written, a dead host does not).
`ProxyProcess` runs one as a child process that can be cut (killed) and healed (restarted on its port).
Two engines relay the same link. `python` (below): threads with blocking sockets and `time.sleep`, not
asyncio (the event loop's epoll timeout rounds sleeps up to whole milliseconds, which would double a 0.5 ms
delay); the reference. `native` (the default where it is built): the optional C extension
`kvmesh.bench._link`, one thread on epoll with a nanosecond timerfd and no GIL; the threaded engine's
wake-ups and GIL hand-offs add ~0.7 ms p50 (1.2 ms p99) to a pull on a 2-core host even with no delay set,
more than the link it emulates.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

try:  # the optional native engine (setup.py builds it; without a C compiler only the threaded one runs)
    from kvmesh.bench import _link

    NATIVE = True
except ImportError:
    NATIVE = False
ENGINES = ("native", "python")
DEFAULT_ENGINE = "native" if NATIVE else "python"

CHUNK = 1 << 20
MAX_QUEUED = 64 << 10  # bytes held per direction when rate-capped
PIECE = 16 << 10  # bytes sent per paced write when rate-capped
PACE_SLACK_S = 0.0002  # how far the sender may run ahead of the cap before it sleeps


@dataclass(frozen=True)
class Link:
    """The link's shape: one-way delay (s), per-direction cap (bytes/s, 0 = none), whether a closed end drops
    the bytes in flight towards the other."""

    delay_s: float
    rate: float = 0.0
    drop_on_close: bool = False

    @property
    def hold_bytes(self) -> int:
        """Bytes held per direction when capped: `MAX_QUEUED`, or twice the bandwidth-delay product when that
        is more (a link carries rate x delay bytes in flight: holding less would cap it below `rate`)."""
        return max(MAX_QUEUED, int(2 * self.rate * self.delay_s))


class Progress:
    """Bytes forwarded target -> clients; prints `forwarded <total>` at every `every` bytes (0 = silent)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.total = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        if not self.every:
            return
        with self._lock:
            before, self.total = self.total, self.total + n
            if self.total // self.every > before // self.every:
                print(f"forwarded {self.total}", flush=True)


class _Pipe:
    """One direction of a connection: read chunks, hand each to the sender with its due time."""

    def __init__(self, src: socket.socket, dst: socket.socket, link: Link, sent: Callable[[int], None]) -> None:
        self.src, self.dst, self.link, self.sent = src, dst, link, sent
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.ready = threading.Condition()
        self.done = False  # the source ended
        self.closed = False  # the sender gave up (the destination failed)

    def receive(self) -> None:
        hold = self.link.hold_bytes
        size = min(hold, CHUNK) if self.link.rate else CHUNK
        try:
            while True:
                with self.ready:  # rate-capped: hold at most MAX_QUEUED (backpressure on the sender)
                    while self.link.rate and self.queued >= hold and not self.closed:
                        self.ready.wait()
                    if self.closed:
                        break
                data = self.src.recv(size)
                if not data:
                    break
                with self.ready:
                    self.queue.append((time.monotonic() + self.link.delay_s, data))
                    self.queued += len(data)
                    self.ready.notify_all()
        except OSError:
            pass
        with self.ready:
            self.done = True
            if self.link.drop_on_close:
                self.queue.clear()
            self.ready.notify_all()

    def send(self) -> None:
        free_at = 0.0  # when the capped link can take the next byte
        try:
            while True:
                with self.ready:
                    while not self.queue and not self.done:
                        self.ready.wait()
                    if not self.queue:
                        break
                    due, data = self.queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                free_at = self._forward(data, free_at)
                with self.ready:
                    self.queued -= len(data)
                    self.ready.notify_all()
        except OSError:
            pass
        with self.ready:
            self.closed = True
            self.ready.notify_all()
        for s in (self.dst, self.src):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _forward(self, data: bytes, free_at: float) -> float:
        """Sends `data`, paced at the link's rate in PIECE writes; returns the new `free_at`."""
        if not self.link.rate:
            self.dst.sendall(data)
            self.sent(len(data))
            return free_at
        view = memoryview(data)
        for start in range(0, len(view), PIECE):
            if self.done and self.link.drop_on_close:
                break
            piece = view[start : start + PIECE]
            free_at = max(free_at, time.monotonic()) + len(piece) / self.link.rate
            self.dst.sendall(piece)
            self.sent(len(piece))
            wait = free_at - time.monotonic()
            if wait > PACE_SLACK_S:  # a sleep costs ~60 us here: pace in bursts of up to the slack, not per piece
                time.sleep(wait)
        return free_at


def _connect(target: tuple[str, int], link: Link) -> socket.socket:
    """A connection to the target; rate-capped, with a small receive buffer set before the handshake (the
    window it advertises is what the sender may have in flight)."""
    family, kind, proto, _, addr = socket.getaddrinfo(*target, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        if link.rate:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, link.hold_bytes)
        s.settimeout(10)
        s.connect(addr)
    except OSError:
        s.close()
        raise
    s.settimeout(None)
    return s


def _serve_connection(client: socket.socket, target: tuple[str, int], link: Link, progress: Progress) -> None:
    try:
        upstream = _connect(target, link)
    except OSError:
        client.close()
        return
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pipes = (_Pipe(client, upstream, link, lambda n: None), _Pipe(upstream, client, link, progress.add))
    for pipe in pipes:
        threading.Thread(target=pipe.receive, daemon=True).start()
        threading.Thread(target=pipe.send, daemon=True).start()


class ProxyProcess:
    """This proxy as a child process to `target`: `cut()` kills it (every connection through it dies),
    `heal()` restarts it on the same port (a link that went down and came back)."""

    def __init__(
        self,
        target: str,
        delay_ms: float = 0.0,
        listen: str = "127.0.0.1",
        rate: float = 0.0,
        engine: str | None = None,
    ) -> None:
        """`engine`: "native" or "python"; None = the proxy's default (`DEFAULT_ENGINE`)."""
        self.target, self.delay_ms, self.listen, self.rate, self.engine = target, delay_ms, listen, rate, engine
        self.port = 0
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", self.target]
        cmd += ["--delay-ms", str(self.delay_ms), "--port", str(self.port), "--listen", self.listen]
        cmd += ["--rate", str(self.rate)]
        if self.engine is not None:
            cmd += ["--engine", self.engine]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the delay proxy exited with {proc.wait(timeout=10)}")
        self.port = int(line)
        return proc

    @property
    def address(self) -> str:
        return f"{self.listen}:{self.port}"

    def cut(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)

    def heal(self) -> None:
        self.proc = self._start()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cut()


Server = Callable[[socket.socket], NoReturn]


def _python_server(target: tuple[str, int], link: Link, report_every: int) -> Server:
    """The threaded engine: an accept loop, 4 threads per connection."""
    progress = Progress(report_every)

    def serve(listener: socket.socket) -> NoReturn:
        while True:
            client, _ = listener.accept()
            _serve_connection(client, target, link, progress)

    return serve


def _native_server(target: tuple[str, int], link: Link, report_every: int) -> Server:
    """The C engine. The target is resolved here, before the port line: the engine takes a numeric address
    (a name lookup would stall its one thread), and a target that does not resolve fails the start."""
    addr = socket.getaddrinfo(*target, type=socket.SOCK_STREAM)[0][4]
    host, port = str(addr[0]), int(addr[1])
    delay_ns = round(link.delay_s * 1e9)

    def serve(listener: socket.socket) -> NoReturn:
        _link.serve(
            listener.fileno(), host, port, delay_ns, link.rate, link.hold_bytes, link.drop_on_close, report_every
        )

    return serve


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.delay_proxy")
    p.add_argument("--target", required=True, help="HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added one way, each direction")
    p.add_argument("--rate", type=float, default=0.0, help="cap per direction and connection, bytes/s (0 = none)")
    p.add_argument("--report-every", type=int, default=0, help="print 'forwarded <bytes>' every N bytes")
    p.add_argument("--drop-on-close", action="store_true", help="a closed end drops the bytes in flight")
    p.add_argument("--listen", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="port to listen on (0 = a free one)")
    p.add_argument("--engine", choices=ENGINES, default=DEFAULT_ENGINE, help=f"relay engine (default {DEFAULT_ENGINE})")
    args = p.parse_args(argv)
    if args.rate < 0 or args.report_every < 0 or args.delay_ms < 0:
        p.error("--delay-ms, --rate and --report-every must be >= 0")
    if args.engine == "native" and not NATIVE:
        p.error("--engine native: the C extension kvmesh.bench._link is not built (`pip install -e .` compiles it)")
    host, port = args.target.rsplit(":", 1)
    link = Link(args.delay_ms / 1000, args.rate, args.drop_on_close)
    make_server = _native_server if args.engine == "native" else _python_server
    serve = make_server((host, int(port)), link, args.report_every)
    listener = socket.create_server((args.listen, args.port))
    print(listener.getsockname()[1], flush=True)
    serve(listener)


if __name__ == "__main__":
    sys.exit(main())
