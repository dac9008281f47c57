"""kvmesh's vLLM general plugins: registered for vLLM's plugin loader; AMX granted where the CPU has it; the
engine processes (not the worker) watch their parent."""

from __future__ import annotations

from importlib.metadata import entry_points

import torch

from kvmesh.kvplane.vllm_connector.plugin import die_with_worker, request_amx_permission


def test_the_plugins_are_registered_for_vllms_loader() -> None:
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvmesh_amx") == "kvmesh.kvplane.vllm_connector.plugin:request_amx_permission"
    assert eps.get("kvmesh_orphans") == "kvmesh.kvplane.vllm_connector.plugin:die_with_worker"


def test_the_worker_itself_does_not_watch_its_parent() -> None:
    # vLLM loads its plugins in the worker's own process too: that one must outlive whatever launched it
    # (tests/unit/core/test_orphans.py: the engine processes it starts do watch)
    assert die_with_worker() is False


def test_amx_is_granted_exactly_where_the_cpu_has_it() -> None:
    # on an AMX machine a refusal here is what made vLLM's AMX attention kernel die with SIGILL
    assert request_amx_permission() is torch.cpu._is_amx_tile_supported()
    assert request_amx_permission() is torch.cpu._is_amx_tile_supported()  # idempotent (loaded per process)
