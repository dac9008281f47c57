"""A userspace TCP delay proxy: a link with added latency where there is no `tc netem`.

    python -m kvmesh.bench.delay_proxy --target HOST:PORT --delay-ms D [--listen 127.0.0.1]

Prints the port it listens on (one line), then forwards every connection to the target, holding each
received chunk D ms before it is sent on, in both directions (the round trip grows by 2 D). Threads with
blocking sockets and `time.sleep`, not asyncio: the event loop's epoll timeout rounds sleeps up to whole
milliseconds, which would double a 0.5 ms delay.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import socket
import sys
import threading
import time
from collections.abc import Sequence

CHUNK = 1 << 20


class _Pipe:
    """One direction of a connection: read chunks, hand each to the sender with its due time."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        self.src, self.dst, self.delay_s = src, dst, delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.done = False

    def receive(self) -> None:
        try:
            while data := self.src.recv(CHUNK):
                with self.ready:
                    self.queue.append((time.monotonic() + self.delay_s, data))
                    self.ready.notify()
        except OSError:
            pass
        with self.ready:
            self.done = True
            self.ready.notify()

    def send(self) -> None:
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
                self.dst.sendall(data)
        except OSError:
            pass
        for s in (self.dst, self.src):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _serve_connection(client: socket.socket, target: tuple[str, int], delay_s: float) -> None:
    try:
        upstream = socket.create_connection(target, timeout=10)
    except OSError:
        client.close()
        return
    upstream.settimeout(None)
    for s in (client, upstream):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for pipe in (_Pipe(client, upstream, delay_s), _Pipe(upstream, client, delay_s)):
        threading.Thread(target=pipe.receive, daemon=True).start()
        threading.Thread(target=pipe.send, daemon=True).start()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench.delay_proxy")
    p.add_argument("--target", required=True, help="HOST:PORT")
    p.add_argument("--delay-ms", type=float, required=True, help="added one way, each direction")
    p.add_argument("--listen", default="127.0.0.1")
    args = p.parse_args(argv)
    host, port = args.target.rsplit(":", 1)
    listener = socket.create_server((args.listen, 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        _serve_connection(client, (host, int(port)), args.delay_ms / 1000)


if __name__ == "__main__":
    sys.exit(main())
