"""Entry point: `python -m kvmesh.services.worker` / `kvmesh-worker`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvmesh.rpc.server import ServiceRunner, run_service
from kvmesh.services.worker.servicer import WorkerServicer
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.v1 import worker_pb2_grpc


async def build(runner: ServiceRunner, settings: WorkerSettings) -> None:
    """Wires the worker's servicer into the runner."""
    runner.add_servicer(worker_pb2_grpc.add_WorkerServiceServicer_to_server, WorkerServicer(),
                        "kvmesh.v1.WorkerService")


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("worker", WorkerSettings, build, argv)


if __name__ == "__main__":
    sys.exit(main())
