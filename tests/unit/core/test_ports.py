"""`free_port` hands out ports below the kernel's ephemeral range (a port-0 bind can never take them before
their process binds them), free now, and never the same one twice."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvmesh.core import ports
from kvmesh.core.ports import ephemeral_range, free_port

pytestmark = pytest.mark.unit


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    low, _ = ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))  # free: this bind would raise otherwise


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        taken = s.getsockname()[1]
        monkeypatch.setattr(ports.random, "randrange", lambda _a, _b: taken)  # the scan starts on it
        got = free_port()
        assert got != taken and 1024 <= got < ephemeral_range()[0]


def test_the_range_is_read_from_the_kernel_or_defaults(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ephemeral_range(str(f)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
    f.write_text("garbage")
    assert ephemeral_range(str(f)) == (32768, 60999)
