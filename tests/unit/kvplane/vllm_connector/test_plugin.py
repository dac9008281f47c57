"""kvmesh's vLLM general plugin: registered for vLLM's plugin loader, and it grants AMX where the CPU has it."""

from __future__ import annotations

from importlib.metadata import entry_points

import torch

from kvmesh.kvplane.vllm_connector.plugin import request_amx_permission


def test_the_plugin_is_registered_for_vllms_loader() -> None:
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvmesh_amx") == "kvmesh.kvplane.vllm_connector.plugin:request_amx_permission"


def test_amx_is_granted_exactly_where_the_cpu_has_it() -> None:
    # on an AMX machine a refusal here is what made vLLM's AMX attention kernel die with SIGILL
    assert request_amx_permission() is torch.cpu._is_amx_tile_supported()
    assert request_amx_permission() is torch.cpu._is_amx_tile_supported()  # idempotent (loaded per process)
