"""Last-known-good endpoint data: the latest catalog snapshot read from the registry, persisted.

A restarted failover service loads it first, so it serves the endpoint sets of before the restart
even while Consul is unreachable. The file is JSON ``{"version": 1, "index", "saved_at",
"instances": [...]}`` written atomically (temp file + fsync + rename); a corrupt or foreign file is
ignored with a warning rather than trusted.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvmesh.core.errors import KvmeshError
from kvmesh.discovery.model import CatalogSnapshot

log = logging.getLogger(__name__)
FORMAT_VERSION = 1


@dataclass(frozen=True)
class LkgRecord:
    index: int
    snapshot: CatalogSnapshot
    saved_at: float


class LastKnownGood:
    """Atomic JSON persistence of one `LkgRecord` at `path`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def save(self, record: LkgRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps(
            {
                "version": FORMAT_VERSION,
                "index": record.index,
                "saved_at": record.saved_at,
                "instances": record.snapshot.to_json(),
            }
        )
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def load(self) -> LkgRecord | None:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("ignoring unreadable last-known-good file %s: %s", self.path, e)
            return None
        try:
            if data.get("version") != FORMAT_VERSION:
                raise ValueError(f"format version {data.get('version')!r}")
            return LkgRecord(int(data["index"]), CatalogSnapshot.from_json(data["instances"]), float(data["saved_at"]))
        except (KvmeshError, KeyError, TypeError, ValueError, AttributeError) as e:
            log.warning("ignoring invalid last-known-good file %s: %s", self.path, e)
            return None
