"""The equivalent mutants of `python -m kvmesh.bench mutation`: mutants that change no behaviour any caller can
observe, so no test can kill them. Each is named as mutmut names it (``python -m mutmut show NAME`` in the
benchmark's working copy prints its diff) with the reason it is equivalent; the benchmark leaves them out of the
kill rate, and reports an entry that no longer exists (the code moved: renumber it) or that a test now kills
(it was not equivalent: drop it).
"""

from __future__ import annotations

_CB = "kvmesh.routing.circuit.xǁCircuitBreakerǁ"
# The breaker's probe counters are read only in HALF_OPEN, which is entered only through `_advance`, and that
# zeroes both; its window counters are read only in CLOSED, which is entered only through `_close` (or at
# construction), and that zeroes them. So what `__init__`, `_open` and `_close` set them to is never read.
_PROBES_UNREAD = "probe counter reset outside HALF_OPEN: `_advance` zeroes it on entering HALF_OPEN, its only reader"
_WINDOW_UNREAD = "window counter reset on opening: never read before `_close` zeroes it again"

EQUIVALENT: dict[str, str] = {
    # kvmesh.routing.circuit
    _CB + "__init____mutmut_11": "`_opened_at = None`: read only in OPEN, and `_open` sets it first",
    _CB + "__init____mutmut_12": "`_opened_at = 1.0`: read only in OPEN, and `_open` sets it first",
    _CB + "__init____mutmut_14": f"`_probes_in_flight = None`: {_PROBES_UNREAD}",
    _CB + "__init____mutmut_15": f"`_probes_in_flight = 1`: {_PROBES_UNREAD}",
    _CB + "__init____mutmut_16": f"`_probe_ok = None`: {_PROBES_UNREAD}",
    _CB + "__init____mutmut_17": f"`_probe_ok = 1`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_9": f"`_probes_in_flight = None`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_10": f"`_probes_in_flight = 1`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_11": f"`_probe_ok = None`: {_PROBES_UNREAD}",
    _CB + "_close__mutmut_12": f"`_probe_ok = 1`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_11": f"`_errors = None`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_12": f"`_errors = 1`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_13": f"`_slow = None`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_14": f"`_slow = 1`: {_WINDOW_UNREAD}",
    _CB + "_open__mutmut_15": f"`_probes_in_flight = None`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_16": f"`_probes_in_flight = 1`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_17": f"`_probe_ok = None`: {_PROBES_UNREAD}",
    _CB + "_open__mutmut_18": f"`_probe_ok = 1`: {_PROBES_UNREAD}",
    _CB + "record__mutmut_47": "`backoff=None` for `backoff=False`: `_open` only tests its truth",
    _CB + "record__mutmut_64": "`backoff=None` for `backoff=False`: `_open` only tests its truth",
    _CB + "record__mutmut_53": "`n_ok >= 0` for `n_ok > 0`: with no success `_slow` is 0 and the rule needs ≥ 1",
    # kvmesh.ops.rollout.canary
    "kvmesh.ops.rollout.canary.x_analyse__mutmut_82": (
        "`new.live_decode_p50_ms >= 0` for `> 0`: a new version reporting 0 is a −100 % change, never at or past "
        "the (validated, ≥ 0) bound"
    ),
    "kvmesh.ops.rollout.canary.x_probe_prompts__mutmut_23": (
        "the seed masked to 65 bits instead of 64: the LCG step multiplies and adds modulo 2^64 before any use, "
        "so only the low 64 bits ever count"
    ),
    # kvmesh.security.authz
    "kvmesh.security.authz.xǁPolicyǁhttp_rule__mutmut_20": (
        "drops `rule.open` when widening a worker generation route for clients: those rules are never open, and "
        "`Rule.open` defaults to False"
    ),
}
