"""Network namespaces for zone fault injection (needs root and iproute2; only own namespaces are touched).

Zone k gets namespace ``<prefix>-<zone>`` and a veth pair: host end ``<tag>h`` = 10.(77+k).S.1/24 in
the root namespace, namespace end ``<tag>n`` = 10.(77+k).S.2/24, where S = pid mod 250 keeps parallel
runs apart. Nothing is forwarded between zones: processes in a zone reach only the root namespace
(Consul, clients), and the root namespace reaches each zone. ``partition`` sets the host end down
(the zone loses its link), ``heal`` sets it up again. Every `ip` call has a 10 s timeout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.suite.launcher import SERVICES, ServiceProcess, wait_ready, wait_serving

IP_TIMEOUT_S = 10.0


def available() -> str | None:
    """None when namespaces can be used here, else the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=IP_TIMEOUT_S)


@dataclass
class Zone:
    name: str
    ns: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    def partition(self) -> None:
        ip("link", "set", self.host_if, "down")

    def heal(self) -> None:
        ip("link", "set", self.host_if, "up")

    def destroy(self) -> None:
        ip("netns", "del", self.ns, check=False)  # also removes the veth pair
        ip("link", "del", self.host_if, check=False)


def create_zone(name: str, k: int, prefix: str = "") -> Zone:
    slot = os.getpid() % 250
    tag = f"k7{slot}{name}"[:13]
    prefix = prefix or f"kvmesh-{os.getpid()}"
    z = Zone(name, f"{prefix}-{name}", f"{tag}h", f"{tag}n", f"10.{77 + k}.{slot}.1", f"10.{77 + k}.{slot}.2")
    z.destroy()  # leftovers of a crashed run with the same pid
    try:
        ip("netns", "add", z.ns)
        ip("link", "add", z.host_if, "type", "veth", "peer", "name", z.ns_if)
        ip("link", "set", z.ns_if, "netns", z.ns)
        ip("addr", "add", f"{z.host_ip}/24", "dev", z.host_if)
        ip("link", "set", z.host_if, "up")
        ip("link", "set", "lo", "up", ns=z.ns)
        ip("addr", "add", f"{z.ns_ip}/24", "dev", z.ns_if, ns=z.ns)
        ip("link", "set", z.ns_if, "up", ns=z.ns)
        ip("route", "add", "default", "via", z.host_ip, ns=z.ns)
    except BaseException:
        z.destroy()
        raise
    return z


def start_in_zone(
    zone: Zone, name: str, tmp: Path, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
) -> ServiceProcess:
    """`python -m <service>` inside the zone's namespace, bound to its address; waits until it serves."""
    tmp.mkdir(parents=True, exist_ok=True)
    ready = tmp / f"{name}-{zone.name}-{time.monotonic_ns()}.ready.json"
    log_path = ready.with_suffix(".log")
    cmd = [
        "ip",
        "netns",
        "exec",
        zone.ns,
        sys.executable,
        "-m",
        SERVICES[name],
        "--host",
        zone.ns_ip,
        "--port",
        "0",
        "--http-port",
        "0",
        "--ready-file",
        str(ready),
        "--zone",
        zone.name,
        *args,
    ]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    sp = ServiceProcess(name, proc, ready, log_path)
    wait_ready(sp, timeout)
    wait_serving(sp.address, timeout)
    return sp
