"""The KV connector of a vLLM worker that hands prefill KV to decode workers by vLLM's own transfer: vLLM's
`MultiConnector` of its `NixlConnector` (the P/D handoff) and kvmesh's connector (the CPU tier and peer
pulls), named in `--kv-transfer-config` by `kv_connector_module_path`, so vLLM imports this module in every
process it starts (front end, engine core, model workers) before it builds a connector.

Two things vLLM's `MultiConnector` needs of its children that kvmesh's connector does not give it by itself:
- a name in `KVConnectorFactory`'s registry: the engine core rebuilds a child's stats from the dicts a model
  worker sent by looking the child's class name up there (`build_kv_connector_stats`); importing this module
  registers `KvmeshConnector`;
- Prometheus metrics: `MultiConnector`'s metrics assert that every child that reports stats made some; this
  one passes on only the stats of children that did (NixlConnector's), and kvmesh reads its own connector's
  counts from the stat logger (`kvmesh.engine.vllm_engine`).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiConnector,
    MultiKVConnectorPromMetrics,
)

__all__ = ["KvmeshHandoffConnector"]  # what vLLM loads from here, by the name vllm_config gives it
KVMESH_CONNECTOR = "KvmeshConnector"
KVMESH_CONNECTOR_MODULE = "kvmesh.kvplane.vllm_connector.connector"


def register_kvmesh_connector() -> None:
    """Registers kvmesh's connector by name with vLLM's factory (once per process)."""
    if KVMESH_CONNECTOR not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(KVMESH_CONNECTOR, KVMESH_CONNECTOR_MODULE, KVMESH_CONNECTOR)


register_kvmesh_connector()


class _ChildPromMetrics(MultiKVConnectorPromMetrics):
    """`MultiConnector`'s metrics, observing only the children that made Prometheus metrics."""

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        known = {k: v for k, v in transfer_stats_data.items() if k in self._prom_metrics}
        super().observe(known, engine_idx)


class KvmeshHandoffConnector(MultiConnector):
    """vLLM's `MultiConnector` (children in `kv_connector_extra_config.connectors`, the first to match a
    request loads it), with metrics for the children that have any."""

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        children: dict[str, KVConnectorPromMetrics] = {}
        for connector_cls, child_config in cls._get_connector_classes_and_configs(vllm_config):
            if connector_cls.__name__ in children:
                continue
            prom = connector_cls.build_prom_metrics(child_config, metric_types, labelnames, per_engine_labelvalues)
            if prom is not None:
                children[connector_cls.__name__] = prom
        return _ChildPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues, children)
