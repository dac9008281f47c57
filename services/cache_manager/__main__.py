"""Entry point: `python -m kvmesh.services.cache_manager` / `kvmesh-cache-manager`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvmesh.rpc.server import ServiceRunner, run_service
from kvmesh.services.cache_manager.servicer import CacheManagerServicer
from kvmesh.services.cache_manager.settings import CacheManagerSettings
from kvmesh.v1 import cache_manager_pb2_grpc


async def build(runner: ServiceRunner, settings: CacheManagerSettings) -> None:
    """Wires the cache-manager's servicer into the runner."""
    runner.add_servicer(cache_manager_pb2_grpc.add_CacheManagerServiceServicer_to_server, CacheManagerServicer(),
                        "kvmesh.v1.CacheManagerService")


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("cache-manager", CacheManagerSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
