"""Free ports on this host, for a process that cannot pick its own (a third-party server, a ZMQ endpoint,
vLLM's NIXL handshake listener) and for the local suite's fixed ports."""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence
from pathlib import Path


def ports_in_use(ports: Sequence[int], host: str = "127.0.0.1") -> list[int]:
    """Those of `ports` that a listening socket holds on `host` already (a bind test, SO_REUSEADDR so that
    TIME_WAIT leftovers do not count: the services' own servers bind the same way)."""
    busy = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError:
                busy.append(port)
    return busy


_HANDED_OUT: set[int] = set()  # ports free_port gave this process: never the same one twice
_FREE_PORT_SPAN = 16384  # how far below the ephemeral range free_port looks


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The ports the kernel gives sockets bound to port 0 (Linux's default where it cannot be read)."""
    try:
        low, high = (int(x) for x in Path(path).read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1", consecutive: int = 1) -> int:
    """A port free on `host` now, for a process that cannot pick its own (redis-server, a ZMQ endpoint, a
    third-party router), or the first of `consecutive` free ports in a row (a service given a first port
    and taking the next ones: `--processes N --process-http-port P`). It comes from below the kernel's
    ephemeral range: a port picked from inside it could be taken by any socket bound to port 0 (every kvmesh
    service started with port 0) before its process binds it, which made runs fail with "Address already in
    use"."""
    low, _ = ephemeral_range()
    first = max(1024, low - _FREE_PORT_SPAN)
    start = random.randrange(first, low - consecutive + 1) if low - consecutive + 1 > first else first
    for port in [*range(start, low - consecutive + 1), *range(first, start)]:
        run = range(port, port + consecutive)
        if any(p in _HANDED_OUT for p in run) or not all(_bindable(host, p) for p in run):
            continue
        _HANDED_OUT.update(run)
        return port
    if consecutive > 1:
        raise OSError(f"no {consecutive} consecutive free ports below {low} on {host}")
    with socket.socket() as s:  # nothing free below the range: the kernel's pick, as before
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
