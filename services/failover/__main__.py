"""Entry point: `python -m kvmesh.services.failover` / `kvmesh-failover`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvmesh.rpc.server import ServiceRunner, run_service
from kvmesh.services.failover.servicer import FailoverServicer
from kvmesh.services.failover.settings import FailoverSettings
from kvmesh.v1 import failover_pb2_grpc


async def build(runner: ServiceRunner, settings: FailoverSettings) -> None:
    """Wires the failover servicer into the runner."""
    runner.add_servicer(failover_pb2_grpc.add_FailoverServiceServicer_to_server, FailoverServicer(),
                        "kvmesh.v1.FailoverService")


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("failover", FailoverSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
