"""One prefix index for the processes of one host: one writer, any number of readers, in shared memory.

`SharedPrefixIndex` is a `NativePrefixIndex` whose table and spill pool are files under /dev/shm: a header at
`path` and one file per array generation (`path.s<gen>`, `path.p<gen>`; a grown array is a new file and the
old one is unlinked). `SharedIndexView` maps them read-only in another process. The header carries a
seqlock: the writer makes its count odd for the length of every change (a store, remove, clear or growth)
and a reader retries a walk that overlapped one (64 tries, then the query answers None and the caller asks
elsewhere), so a reader never acts on half a change. A reader holds no copy: N router processes hold one
index, and only the writer follows the cache-manager.

Worker names (the core's slot numbers) are published in `path.names` (JSON, replaced atomically) with
their version in header word `NAMES_VERSION`; a reader reloads them when the version moves and discards a
query during which it moved. Words 1 to 7 are the owner's (`word`, `set_word`; e.g. the state of a replica,
`kvmesh.replica.shared`), 0 for each new writer.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os

from kvmesh.index import _native
from kvmesh.index.native_index import HashesLike, NativePrefixIndex, _arg

__all__ = ["SharedIndexView", "SharedPrefixIndex", "remove_files"]

NAMES_VERSION = 0  # header word 0: counts on across writers
_NAME_RETRIES = 3  # queries during which the names moved, before answering None


def _names_path(path: str) -> str:
    return path + ".names"


def remove_files(path: str) -> None:
    """Unlink the header, names and every array file of the shared index at `path` (readers still mapping
    them keep their memory until they unmap it)."""
    for f in [path, *glob.glob(glob.escape(path) + ".*")]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f)


class SharedPrefixIndex(NativePrefixIndex):
    """The writer (see the module docstring); a new one at the same path takes the header over (a restarted
    writer, or a replica reset), readers follow it without reopening."""

    def __init__(self, path: str, capacity: int = 1024) -> None:
        super().__init__(capacity, shared=path)
        self.path = path
        self._publish_names()

    def _slot(self, worker: str) -> int:
        known = worker in self._slot_of
        slot = super()._slot(worker)
        if not known:
            self._publish_names()
        return slot

    def remove_worker(self, worker: str) -> None:
        known = worker in self._slot_of
        super().remove_worker(worker)
        if known:
            self._publish_names()

    def _publish_names(self) -> None:
        tmp = f"{_names_path(self.path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(self._names, f)
        os.replace(tmp, _names_path(self.path))
        self.set_word(NAMES_VERSION, self.word(NAMES_VERSION) + 1)

    def word(self, i: int) -> int:
        return self._core.word(i)

    def set_word(self, i: int, value: int) -> None:
        self._core.set_word(i, value)


class SharedIndexView:
    """A reader of the `SharedPrefixIndex` at `path` (OSError / ValueError if there is none yet)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._names: list[str | None] = []  # shared with the view: mutated in place
        self._ids: dict[str, int] = {}
        self._version = -1
        self.inode = os.stat(path).st_ino
        self._view = _native.IndexView(path, self._names)

    def replaced(self) -> bool:
        """The header file is gone or another one is at `path` (a new writer): reopen."""
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def word(self, i: int) -> int:
        return self._view.word(i)

    def _sync_names(self) -> int | None:
        v = self._view.word(NAMES_VERSION)
        if v != self._version:
            try:
                with open(_names_path(self.path)) as f:
                    names: list[str | None] = json.load(f)
            except (OSError, ValueError):
                return None
            self._names[:] = names
            self._ids = {n: i for i, n in enumerate(names) if n is not None}
            self._version = v
        return v

    def find_matches(self, hashes: HashesLike) -> dict[str, int] | None:
        """As `NativePrefixIndex.find_matches`; None when no read saw one state of the index and its names."""
        for _ in range(_NAME_RETRIES):
            v = self._sync_names()
            if v is None:
                return None
            found = self._view.find_matches(_arg(hashes))
            if found is None or self._view.word(NAMES_VERSION) == v:
                return found
        return None

    def first_held(self, worker: str, hashes: HashesLike) -> int | None:
        """The first position of `hashes` whose block `worker` holds (len(hashes) if none); None as above."""
        for _ in range(_NAME_RETRIES):
            v = self._sync_names()
            if v is None:
                return None
            w = self._ids.get(worker)
            if w is None:
                return len(hashes)
            at = self._view.first_held(w, _arg(hashes))
            if at is None or self._view.word(NAMES_VERSION) == v:
                return at
        return None

    def pairs(self) -> int:
        """(worker, block) pairs, as the writer last published them."""
        return self._view.stats()[2]

    def stats(self) -> dict[str, int]:
        cap, entries, pairs, retries, failures = self._view.stats()
        return {"capacity": cap, "blocks": entries, "pairs": pairs, "retries": retries, "failures": failures}
