"""File checkpoint store (the embedded default): `snapshot.bin` + `log.<epoch>.bin` in one directory.

Snapshot write: temp file → fsync → rename over `snapshot.bin` → fsync the directory (atomic: a reader
sees the old or the new snapshot, never a torn one); the previous epoch's log is deleted afterwards.
Snapshot file = magic `KVMS1` | epoch (u64 LE) | crc32 (u32 LE) | payload.
Log record = length (u32 LE) | crc32 (u32 LE) | bytes; a torn or corrupt tail (a crash mid-append) ends
the log there. `fsync_appends` makes each `append` durable before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

from kvmesh.core.errors import KvmeshError, ResourceExhausted, Unavailable
from kvmesh.store.base import RETRY_AFTER_S, Loaded

MAGIC = b"KVMS1"
_HDR = struct.Struct("<QI")
_REC = struct.Struct("<II")


class FileCheckpointStore:
    """`CheckpointStore` in a local directory (blocking I/O runs in a thread)."""

    def __init__(self, directory: str | os.PathLike[str], fsync_appends: bool = True) -> None:
        self.dir = Path(directory)
        self.fsync_appends = fsync_appends
        self.epoch = 0
        self._log: object | None = None
        self.dir.mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------- sync core
    def _log_path(self, epoch: int) -> Path:
        return self.dir / f"log.{epoch}.bin"

    def load_sync(self) -> Loaded:
        """Blocking `load`."""
        snap_path = self.dir / "snapshot.bin"
        snapshot: bytes | None = None
        epoch = 0
        if snap_path.exists():
            raw = snap_path.read_bytes()
            if not raw.startswith(MAGIC):
                raise ValueError(f"{snap_path}: not a kvmesh snapshot")
            epoch, crc = _HDR.unpack_from(raw, len(MAGIC))
            snapshot = raw[len(MAGIC) + _HDR.size :]
            if zlib.crc32(snapshot) != crc:
                raise ValueError(f"{snap_path}: checksum mismatch")
        self.epoch = epoch
        records = self._read_log(self._log_path(epoch))
        return Loaded(snapshot, epoch, records)

    @staticmethod
    def _read_log(path: Path) -> list[bytes]:
        if not path.exists():
            return []
        data = path.read_bytes()
        out, pos = [], 0
        while pos + _REC.size <= len(data):
            n, crc = _REC.unpack_from(data, pos)
            body = data[pos + _REC.size : pos + _REC.size + n]
            if len(body) < n or zlib.crc32(body) != crc:
                break  # torn tail
            out.append(body)
            pos += _REC.size + n
        return out

    def _error(self, e: OSError, what: str) -> KvmeshError:
        """The store's error for a failed write (see `kvmesh.store.base`)."""
        where = f"checkpoint store {self.dir}: {what} failed: {e.strerror or e}"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return ResourceExhausted(f"{where} (the store is full)", RETRY_AFTER_S)
        return Unavailable(where)

    def save_snapshot_sync(self, snapshot: bytes) -> int:
        """Blocking `save_snapshot`."""
        new_epoch = self.epoch + 1
        tmp = self.dir / f".snapshot.{os.getpid()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _HDR.pack(new_epoch, zlib.crc32(snapshot)))
                f.write(snapshot)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # a half-written snapshot would hold the space the next one needs
            raise self._error(e, "writing the snapshot") from e
        os.replace(tmp, self.dir / "snapshot.bin")
        self._fsync_dir()
        old = self._log_path(self.epoch)
        self._close_log()
        self.epoch = new_epoch
        old.unlink(missing_ok=True)
        return new_epoch

    def append_sync(self, records: Sequence[bytes]) -> None:
        """Blocking `append`."""
        if not records:
            return
        path = self._log_path(self.epoch)
        size = -1
        try:
            if self._log is None:
                self._log = open(path, "ab")  # noqa: SIM115 - kept open across appends
            f = self._log
            size = f.tell()  # type: ignore[attr-defined]
            f.write(b"".join(_REC.pack(len(r), zlib.crc32(r)) + r for r in records))  # type: ignore[attr-defined]
            f.flush()  # type: ignore[attr-defined]
            if self.fsync_appends:
                os.fsync(f.fileno())  # type: ignore[attr-defined]
        except OSError as e:
            # what did not fit is dropped with the file object's buffer; the torn tail is cut off so that the
            # log ends on a whole record (an append after it must not follow garbage)
            if self._log is not None:
                with contextlib.suppress(OSError, ValueError):
                    self._log.close()  # type: ignore[attr-defined]
                self._log = None
            if size >= 0:
                with contextlib.suppress(OSError):
                    os.truncate(path, size)
            raise self._error(e, "appending to the log") from e

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None

    # -------------------------------------------------------------- async protocol
    async def load(self) -> Loaded:
        """See `CheckpointStore.load`."""
        return await asyncio.to_thread(self.load_sync)

    async def save_snapshot(self, snapshot: bytes) -> int:
        """See `CheckpointStore.save_snapshot`."""
        return await asyncio.to_thread(self.save_snapshot_sync, snapshot)

    async def append(self, records: Sequence[bytes]) -> None:
        """See `CheckpointStore.append`."""
        await asyncio.to_thread(self.append_sync, list(records))

    async def close(self) -> None:
        """See `CheckpointStore.close`."""
        self._close_log()
