"""`--processes`: how many router processes a value means, and a bad value refused before anything starts."""

import socket

import pytest

from kvmesh.rpc.processes import MAX_PROCESSES, process_count
from kvmesh.services.router.__main__ import main

pytestmark = pytest.mark.unit


def test_zero_means_one_per_core_up_to_the_cap() -> None:
    assert process_count(0, cores=2) == 2
    assert process_count(0, cores=64) == MAX_PROCESSES
    assert process_count(3, cores=2) == 3  # an explicit count is kept (e.g. more processes than cores)


def test_a_negative_count_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="processes: must be >= 0"):
        process_count(-1)
    assert main(["--processes", "-1", "--workers", "127.0.0.1:1"]) == 2
    assert "processes: must be >= 0" in capsys.readouterr().err


def test_a_taken_port_is_a_clear_error_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--processes", "2", "--port", str(port), "--workers", "127.0.0.1:1"]) == 2
    assert f"cannot bind 127.0.0.1:{port}" in capsys.readouterr().err
