"""Real service processes for tests (see kvmesh.launcher): port 0, readiness without sleeps."""

from kvmesh.launcher import SERVICES, ServiceProcess, start_service, wait_ready, wait_serving

__all__ = ["SERVICES", "ServiceProcess", "start_service", "wait_ready", "wait_serving"]
