"""The Consul stand-in's check runner against a real TCP listener on 127.0.0.1: a service deregistered and
registered again under the same id and check definition (a restarted service on its known port) is probed again,
as a real agent's AddCheck starts a new runner, even when the old registration's probe ended in between."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.consul_standin.checks import CheckRunner
from tests.consul_standin.state import AgentState, Check, Service

pytestmark = pytest.mark.integration

CHECK_ID = "service:cache-manager-a-47100"


@pytest.fixture
async def listener() -> AsyncIterator[int]:
    def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


def register(state: AgentState, port: int) -> None:
    svc = Service("cache-manager-a-47100", "kvmesh-cache-manager", [], {}, "127.0.0.1", port, {"Passing": 1})
    check = Check(CHECK_ID, "tcp", svc.id, svc.name, "tcp", interval_s=0.05, timeout_s=2.0, tcp=f"127.0.0.1:{port}")
    state.upsert_service(svc, [check])


async def status_becomes(state: AgentState, status: str, timeout_s: float = 10.0) -> None:
    async with state.cond:
        await asyncio.wait_for(state.cond.wait_for(lambda: state.checks[CHECK_ID].status == status), timeout_s)


@pytest.fixture
async def probed(listener: int) -> AsyncIterator[tuple[AgentState, CheckRunner]]:
    """The check registered and its probe started, once it has passed."""
    state = AgentState()
    runner = CheckRunner(state)
    try:
        register(state, listener)
        runner.sync_probes()
        await status_becomes(state, "passing")
        yield state, runner
    finally:
        await runner.stop()


async def test_a_check_registered_again_under_its_id_after_its_probe_ended_is_probed_again(
    probed: tuple[AgentState, CheckRunner], listener: int
) -> None:
    state, runner = probed
    first = runner.probe_of(CHECK_ID)
    assert first is not None
    state.remove_service("cache-manager-a-47100")
    await asyncio.wait_for(first, 10.0)  # the old probe sees its check gone and ends, before the runner looks
    register(state, listener)  # the restarted instance: same id, same definition, a new registration
    assert state.checks[CHECK_ID].status == "critical"  # as Consul registers a check without a status
    runner.sync_probes()
    await status_becomes(state, "passing")
    assert runner.probe_of(CHECK_ID) is not first


async def test_an_unchanged_re_registration_keeps_its_probe_and_status(
    probed: tuple[AgentState, CheckRunner], listener: int
) -> None:
    state, runner = probed
    first = runner.probe_of(CHECK_ID)
    register(state, listener)  # an identical re-registration changes nothing, as in Consul
    runner.sync_probes()
    assert state.checks[CHECK_ID].status == "passing"
    assert runner.probe_of(CHECK_ID) is first
