"""Static-registry probe policy (kvmesh.discovery.checks): failures / successes thresholds, worst-of health."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.discovery.checks import ProbePolicy, ProbeState, probed_snapshot, step_probe
from kvmesh.discovery.model import CatalogSnapshot, Health, Role, ServiceInstance

pytestmark = pytest.mark.unit

POLICY = ProbePolicy(interval_s=0.5, timeout_s=0.5, failures=3, successes=2)


def run(results: list[bool], state: ProbeState | None = None) -> list[Health]:
    st = state or ProbeState()
    out = []
    for ok in results:
        st = step_probe(st, ok, POLICY)
        out.append(st.health)
    return out


def test_critical_after_n_consecutive_failures_passing_after_m_successes() -> None:
    P, C = Health.PASSING, Health.CRITICAL
    assert run([False, False, False]) == [P, P, C]
    assert run([False, False, False, True, True]) == [P, P, C, C, P]


def test_an_interrupted_streak_starts_over() -> None:
    P, C = Health.PASSING, Health.CRITICAL
    assert run([False, False, True, False, False]) == [P, P, P, P, P]
    assert run([False, False, False, True, False, True, True]) == [P, P, C, C, C, C, P]


def test_probed_health_is_the_worst_of_file_and_probes() -> None:
    def inst(iid: str, health: Health) -> ServiceInstance:
        return ServiceInstance(iid, Role.ROUTER, "a", "v1", "127.0.0.1", 1, health)

    snap = CatalogSnapshot.of(
        [inst("dead", Health.PASSING), inst("marked", Health.CRITICAL), inst("new", Health.WARNING)]
    )
    states = {"dead": ProbeState(Health.CRITICAL), "marked": ProbeState(Health.PASSING)}
    got = {i.id: i.health for i in probed_snapshot(snap, states).instances}
    assert got == {"dead": Health.CRITICAL, "marked": Health.CRITICAL, "new": Health.WARNING}


@pytest.mark.parametrize("field", ["interval_s", "timeout_s", "failures", "successes"])
def test_policy_rejects_non_positive_values(field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        ProbePolicy(**{field: 0})
    assert err.value.field == field
