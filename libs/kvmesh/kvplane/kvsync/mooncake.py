"""The process's Mooncake Transfer Engine (TE): one per process, started on first use, for kv-sync's
`mooncake` transport (one-sided reads of a peer's registered tier region, over TCP here, RDMA on fleets).

A server registers each served region's whole segment once (`export`) and tells its session and the
segment's base address in Describe; a client reads slot headers and data with one batch per pull
(`MooncakeEngine.read`) into memory registered with its own TE: the caller's buffer when it lies in a
registered region (`register`, e.g. a worker's pull staging region), else a pooled staging arena
(`arena`). TE checks nothing and holds no leases: the lease and the checks (generation, digest, CRC32C on
the reader's copy) stay kv-sync's (`kvmesh.kvplane.kvsync.client`).

TE is optional: when `mooncake.engine` does not import or the engine does not initialise, `engine()` is
None (one log line says why) and the transport is simply not offered. Its hostname must be the address
peers reach this process at: `configure(host)` before first use (a worker passes its advertised host).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

ARENA_MIN_BYTES = 1 << 20
PROGRESS_TIMEOUT_S = 3  # MC_TCP_PROGRESS_TIMEOUT_SEC unless the environment sets it
# merged reads stop growing here: 64 MiB read as 1 MiB pieces went at 0.99 GB/s (p50), as one at 0.47
MAX_PIECE_BYTES = 1 << 20
ARENAS_KEPT = 4  # staging arenas kept registered between pulls (more concurrent pulls allocate, then free)
# Waiting for a batch: TE's own synchronous read spins on the batch's status, a core's worth of CPU that TE's
# I/O threads and the peer need on a small host (32 x 16 KiB on 2 loaded cores: p90 7.6 ms spinning, 0.45 ms
# sleeping between polls). The pause grows with the wait (at most `POLL_SHARE` of it, within these bounds), so
# a short read ends within ~0.1 ms of TE finishing it and a long one costs few wake-ups.
POLL_MIN_S = 20e-6
POLL_MAX_S = 1e-3
POLL_SHARE = 0.05
# the pool threads' timer slack: Linux's default 50 us stretches each 20 us pause to ~85 us (1 us: ~35 us)
POLL_TIMER_SLACK_NS = 1_000
_PR_SET_TIMERSLACK = 29
_WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def _transfer_timeout_s() -> int:
    """TE's own bound on a synchronous batch: `MC_TRANSFER_TIMEOUT` s (TE reads it with atoi; at least 5),
    default 30; TE adds 1 s per GB moved."""
    raw = os.environ.get("MC_TRANSFER_TIMEOUT", "")
    digits = raw.strip().lstrip("+")
    return max(5, int(digits)) if digits.isdigit() else 30


TRANSFER_TIMEOUT_S = _transfer_timeout_s()


def buffer_address(view: memoryview) -> int:
    """Virtual address of a writable, contiguous buffer's first byte (the ctypes view is dropped at once,
    so the buffer is not left exported)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _tight_timer() -> None:
    """Lowers the calling thread's timer slack (Linux `prctl`; elsewhere nothing), so that its short sleeps
    between polls of TE's batches end close to when asked."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, POLL_TIMER_SLACK_NS, 0, 0, 0)


def reachable_host(host: str) -> str:
    """`host`, or this machine's address when `host` is a wildcard bind address (TE publishes its hostname
    to peers, who connect to it)."""
    if host not in _WILDCARD_HOSTS:
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def coalesce(
    local: Sequence[int], remote: Sequence[int], lengths: Sequence[int]
) -> tuple[list[int], list[int], list[int]]:
    """The same reads, in the order of their remote addresses, each run of pieces adjacent on both sides
    merged into one (consecutive slots' headers and data are adjacent in a region: a pull of blocks stored in
    a row becomes two reads, and TE over TCP pays per read: 64 pieces of a 32 x 16 KiB pull took 3.3 ms on
    loopback, two 0.23 ms). A merged piece stays within `MAX_PIECE_BYTES`: TE moves several pieces at once."""
    out_local: list[int] = []
    out_remote: list[int] = []
    out_lengths: list[int] = []
    for there, here, n in sorted(zip(remote, local, lengths, strict=True)):
        if (
            out_lengths
            and out_local[-1] + out_lengths[-1] == here
            and out_remote[-1] + out_lengths[-1] == there
            and out_lengths[-1] + n <= MAX_PIECE_BYTES
        ):
            out_lengths[-1] += n
        else:
            out_local.append(here)
            out_remote.append(there)
            out_lengths.append(n)
    return out_local, out_remote, out_lengths


def listening_ports() -> list[int]:
    """The TCP ports this process listens on (from /proc: its socket inodes among the LISTEN sockets of its
    network namespace). TE in P2PHANDSHAKE mode listens on two: its handshake port (`get_rpc_port`) and its
    TCP data port, random, which peers learn in the handshake; a relay in front of TE must carry both."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/self/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # state 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


@dataclass(frozen=True)
class Export:
    """A region segment registered with the engine: peers read it at `base` through `session`."""

    session: str
    base: int
    nbytes: int


class TransferFailed(Exception):
    """TE did not move the bytes (cannot connect, a transfer error): the pull goes on over the next transport."""


class _Arena:
    """A registered staging buffer; `busy`: a batch read into it that a cancelled caller left running."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.empty(nbytes, dtype=np.uint8)
        self.view = memoryview(self.array.data)
        self.address = int(self.array.ctypes.data)
        self.nbytes = nbytes
        self.busy: asyncio.Future[int] | None = None


class MooncakeEngine:
    """The process's TE (`engine()` makes it): registrations, staging arenas and batch reads."""

    def __init__(self, te: Any, host: str) -> None:
        self._te = te
        self.session = f"{host}:{te.get_rpc_port()}"
        self._ranges: dict[int, int] = {}  # registered start address -> end address
        self._free: list[_Arena] = []
        # TE's calls release the GIL: waiting for its batches on these threads keeps the event loop free
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvsync-mooncake", initializer=_tight_timer)
        self.in_flight = 0  # batch reads under way (tests wait on it to kill a peer mid-read)

    def register(self, view: memoryview) -> Export:
        """Registers a buffer (e.g. a region's whole segment) for one-sided access; the caller keeps it
        mapped until `unregister`."""
        base, nbytes = buffer_address(view), len(view)
        if base not in self._ranges:
            rc = self._te.register_memory(base, nbytes)
            if rc != 0:
                raise TransferFailed(f"register_memory({nbytes} B) returned {rc}")
            self._ranges[base] = base + nbytes
        return Export(self.session, base, nbytes)

    def unregister(self, export: Export) -> None:
        """Ends a registration (before the memory is unmapped: a peer's read must not reach freed pages)."""
        if self._ranges.pop(export.base, None) is not None:
            self._te.unregister_memory(export.base)

    def registered_all(self, addresses: Sequence[int], sizes: Sequence[int]) -> bool:
        """Whether every [address, address + size) lies inside one registered buffer (a pull's landing
        buffers: usually slices of one staging region, checked against it first)."""
        ranges = sorted(self._ranges.items(), key=lambda r: r[0])
        last: tuple[int, int] | None = None
        for address, nbytes in zip(addresses, sizes, strict=True):
            if last is not None and last[0] <= address and address + nbytes <= last[1]:
                continue
            last = next(((s, e) for s, e in ranges if s <= address and address + nbytes <= e), None)
            if last is None:
                return False
        return True

    @contextlib.contextmanager
    def arena(self, nbytes: int) -> Iterator[_Arena]:
        """A registered staging buffer of at least `nbytes`, pooled: taken for the block of the `with`."""
        fits = [a for a in self._free if a.nbytes >= nbytes]
        if fits:
            arena = min(fits, key=lambda a: a.nbytes)
            self._free.remove(arena)
        else:
            arena = _Arena(max(ARENA_MIN_BYTES, 1 << (nbytes - 1).bit_length()))
            self.register(arena.view)
        try:
            yield arena
        finally:
            if arena.busy is not None and not arena.busy.done():  # back once TE is done writing it
                arena.busy.add_done_callback(lambda _: self._give_back(arena))
            else:
                self._give_back(arena)

    def _give_back(self, arena: _Arena) -> None:
        arena.busy = None
        self._free.append(arena)
        while len(self._free) > ARENAS_KEPT:
            dropped = min(self._free, key=lambda a: a.nbytes)
            self._free.remove(dropped)
            self.unregister(Export(self.session, dropped.address, dropped.nbytes))

    async def read(
        self,
        session: str,
        local: Sequence[int],
        remote: Sequence[int],
        lengths: Sequence[int],
        only_into: _Arena | None = None,
    ) -> None:
        """One TE batch read (adjacent pieces merged), waited for on a thread (`_read_pieces`); raises
        TransferFailed when TE reports a failure.

        `only_into`: every local address lies in that arena of `arena()`, so a cancelled caller returns at
        once (a stalled peer's read must not outlast the pull's deadline) and the arena goes back to the pool
        only when TE is done with it. Otherwise (reads into the caller's own registered memory) a cancelled
        caller waits for the batch to end, so that no byte lands there after this returns: TE fails the
        batch when the connection breaks, or after `MC_TCP_PROGRESS_TIMEOUT_SEC` without progress."""
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        pieces = coalesce(local, remote, lengths)
        batch = loop.run_in_executor(self._pool, self._read_pieces, session, *pieces)
        batch.add_done_callback(self._ended)
        try:
            rc = await asyncio.shield(batch)
        except asyncio.CancelledError:
            if only_into is not None:
                only_into.busy = batch
            else:
                with contextlib.suppress(Exception):
                    await batch
            raise
        if rc < 0:
            raise TransferFailed(f"batch read from {session} returned {rc}")

    def _ended(self, _batch: asyncio.Future[int]) -> None:
        self.in_flight -= 1

    def _read_pieces(self, session: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        """TE's synchronous batch read without its busy wait (on a pool thread): one TE batch per piece
        (`transfer_check_status` follows a batch's first task only), every one submitted before any is
        waited for, then polled with pauses until all have ended. 0 when every piece landed, else < 0; it
        returns only once no batch can still write (or after TE's own bound on a batch, as TE's does)."""
        batches = []
        for here, there, n in zip(local, remote, lengths, strict=True):
            batch = self._te.batch_transfer_async_read(session, [here], [there], [n])
            if batch <= 0:  # not submitted (cannot connect, no such segment): nothing of it will land
                break
            batches.append(batch)
        failed = len(batches) < len(local)
        start = time.monotonic()
        give_up = start + TRANSFER_TIMEOUT_S + sum(lengths) / 1e9
        pending = batches
        while pending:  # bounded: each batch completes or fails within TE's timeouts, and give_up ends it
            # 1 done (TE frees the batch), 0 running, -1 failed (freed), -2 timed out
            states = [self._te.transfer_check_status(b) for b in pending]
            failed = failed or any(rc < 0 for rc in states)
            pending = [b for b, rc in zip(pending, states, strict=True) if rc == 0]
            if not pending:
                break
            now = time.monotonic()
            if now > give_up:
                log.warning(
                    "kv-sync: %d mooncake batch reads from %s still running after %.0f s",
                    len(pending),
                    session,
                    now - start,
                )
                return -1
            time.sleep(min(POLL_MAX_S, max(POLL_MIN_S, POLL_SHARE * (now - start))))
        return -1 if failed else 0


_lock = threading.Lock()
_host = os.environ.get("KVMESH_MOONCAKE_HOST", "127.0.0.1")
# TE's data transport: "tcp" everywhere; "rdma" where the hosts have RDMA NICs (libibverbs)
_protocol = os.environ.get("KVMESH_MOONCAKE_PROTOCOL", "tcp")
_engine: MooncakeEngine | None = None
_tried = False


def configure(host: str) -> None:
    """Sets the hostname the process's TE will publish (the address peers reach); only before first use."""
    global _host
    with _lock:
        if _tried and _engine is not None and not _engine.session.startswith(f"{reachable_host(host)}:"):
            log.warning("mooncake TE already runs as %s; not switching to host %s", _engine.session, host)
        _host = reachable_host(host)


def engine() -> MooncakeEngine | None:
    """The process's TE, started on first call; None when Mooncake cannot run here (logged once)."""
    global _engine, _tried
    with _lock:
        if _tried:
            return _engine
        _tried = True
        # TE drops a TCP transfer that makes no progress for this long (its default, 30 s, would hold a
        # pull into the caller's registered memory that long past its deadline when the peer stalls)
        os.environ.setdefault("MC_TCP_PROGRESS_TIMEOUT_SEC", str(PROGRESS_TIMEOUT_S))
        try:
            from mooncake.engine import TransferEngine  # optional dependency
        except ImportError as e:
            log.info("kv-sync: mooncake transport not offered: %s", e)
            return None
        te = TransferEngine()
        rc = te.initialize(_host, "P2PHANDSHAKE", _protocol, "")
        if rc != 0:
            why = "kv-sync: mooncake transport not offered: TE initialize(%s, %s) returned %d"
            log.warning(why, _host, _protocol, rc)
            return None
        _engine = MooncakeEngine(te, _host)
        log.info("kv-sync: mooncake transfer engine up as %s", _engine.session)
        return _engine


def running() -> MooncakeEngine | None:
    """The process's TE if it has started (never starts it): for memory worth registering only where
    Mooncake is in use, e.g. a worker's pull staging region."""
    return _engine
