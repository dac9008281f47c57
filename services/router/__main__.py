"""Entry point: `python -m kvmesh.services.router` / `kvmesh-router`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvmesh.rpc.server import ServiceRunner, run_service
from kvmesh.services.router.servicer import RouterAdminServicer, RouterServicer
from kvmesh.services.router.settings import RouterSettings
from kvmesh.v1 import router_pb2_grpc


async def build(runner: ServiceRunner, settings: RouterSettings) -> None:
    """Wires the router's servicers into the runner."""
    runner.add_servicer(router_pb2_grpc.add_RouterServiceServicer_to_server, RouterServicer(),
                        "kvmesh.v1.RouterService")
    runner.add_servicer(router_pb2_grpc.add_RouterAdminServiceServicer_to_server, RouterAdminServicer(),
                        "kvmesh.v1.RouterAdminService")


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("router", RouterSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
