"""A routing profile: filters → weighted scorers → picker, built from YAML and changeable at run time.

    candidates = f_k(… f_1(workers))                    each filter keeps the allowed workers
    total(w)   = Σ_s weight_s · cost_s(w)                every scorer's cost is normalised, lower is better
    worker     = picker(candidates, total)

YAML (see `default_profile.yaml`; `type` names are the registry keys of `filters`, `scorers`, `pickers`):

    name: default
    filters: [healthy, not-draining, circuit-closed, {type: kv-headroom, params: {max_usage: 0.95}}]
    scorers:
      - {type: cost, weight: 1.0, params: {prefill_weight: 0.5, decode_weight: 0.5}}
      - {type: session-affinity, name: affinity, weight: 0.5}
    picker: {type: min-cost, params: {epsilon: 0.02, choices: 2}}

`set_weights(prefill_weight=0.7, decode_weight=0.3)` re-weights the `cost` scorer (alpha = 0.7) and the
`prefill-cost` / `decode-load` scorers if the profile has them; other scorers are re-weighted by name.
The next `decide` uses the new weights. No I/O, no clock, no threads: the caller owns the views.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

import yaml

from kvmesh.core.errors import InvalidArgument
from kvmesh.routing import filters as _filters  # noqa: F401  (registers the filters)
from kvmesh.routing import pickers as _pickers  # noqa: F401
from kvmesh.routing import scorers as _scorers  # noqa: F401
from kvmesh.routing.plugin import FILTERS, PICKERS, SCORERS, Factory, Filter, Picker, Scorer
from kvmesh.routing.types import Decision, RoutingQuery, WorkerView

log = logging.getLogger("kvmesh.routing")

BASELINES = ("round-robin", "random", "least-loaded")


def _build(registry: dict[str, Factory], spec: Any, kind: str, seed: int | None) -> tuple[Any, dict[str, Any]]:
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict) or "type" not in spec:
        raise InvalidArgument(kind, f"each {kind} needs a 'type': {spec!r}")
    type_name = spec["type"]
    factory = registry.get(type_name)
    if factory is None:
        raise InvalidArgument(kind, f"unknown {kind} type {type_name!r}; known: {sorted(registry)}")
    params = dict(spec.get("params") or {})
    if seed is not None and "seed" not in params and "seed" in inspect.signature(factory).parameters:
        params["seed"] = seed
    try:
        obj = factory(**params)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(kind, f"{type_name}: {e}") from e
    if spec.get("name"):
        obj.name = str(spec["name"])
    return obj, spec


class Profile:
    """The routing pipeline. `decide(req, workers)` is pure apart from picker state (RNG, round-robin)."""

    def __init__(
        self,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker,
        name: str = "custom",
    ) -> None:
        names = [s.name for s, _ in scorers]
        if len(set(names)) != len(names):
            raise InvalidArgument("scorers", f"scorer names must be unique: {names}")
        for _, wgt in scorers:
            if wgt < 0:
                raise InvalidArgument("weight", "scorer weights must be >= 0")
        self.name = name
        self.filters = list(filters)
        self.scorers: list[list[Any]] = [[s, float(w)] for s, w in scorers]
        self.picker = picker

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, spec: Mapping[str, Any], seed: int | None = None) -> Profile:
        """Build from a parsed YAML mapping; `seed` is passed to every seeded plugin that has none."""
        if not isinstance(spec, Mapping):
            raise InvalidArgument("profile", "a profile is a mapping")
        unknown = set(spec) - {"name", "filters", "scorers", "picker"}
        if unknown:
            raise InvalidArgument("profile", f"unknown keys {sorted(unknown)}")
        filters = [_build(FILTERS, f, "filter", seed)[0] for f in spec.get("filters") or []]
        scorers = []
        for s in spec.get("scorers") or []:
            obj, raw = _build(SCORERS, s, "scorer", seed)
            scorers.append((obj, float(raw.get("weight", 1.0))))
        picker, _ = _build(PICKERS, spec.get("picker") or "min-cost", "picker", seed)
        return cls(filters, scorers, picker, name=str(spec.get("name", "custom")))

    @classmethod
    def from_yaml(cls, text: str, seed: int | None = None) -> Profile:
        """Build from YAML text (one profile document)."""
        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise InvalidArgument("profile", f"invalid YAML: {e}") from e
        return cls.from_dict(spec, seed=seed)

    @classmethod
    def default(cls, seed: int | None = None) -> Profile:
        """The profile shipped with the package (`default_profile.yaml`)."""
        text = resources.files("kvmesh.routing").joinpath("default_profile.yaml").read_text()
        return cls.from_yaml(text, seed=seed)

    @classmethod
    def baseline(cls, picker: str, seed: int | None = None) -> Profile:
        """A comparison profile: health filters + one baseline picker (round-robin, random, least-loaded)."""
        if picker not in BASELINES:
            raise InvalidArgument("picker", f"baseline must be one of {BASELINES}")
        return cls.from_dict(
            {"name": picker, "filters": ["healthy", "not-draining", "circuit-closed"], "picker": picker},
            seed=seed,
        )

    # ---- run time --------------------------------------------------------------------------------
    def weights(self) -> dict[str, float]:
        """Current weights: every scorer's weight, plus alpha of a `cost` scorer as `cost.prefill_weight`."""
        out: dict[str, float] = {}
        for s, w in self.scorers:
            out[s.name] = w
            if hasattr(s, "alpha"):
                out[f"{s.name}.prefill_weight"] = s.alpha
                out[f"{s.name}.decode_weight"] = 1.0 - s.alpha
        return out

    def set_weights(
        self,
        prefill_weight: float | None = None,
        decode_weight: float | None = None,
        scorer_weights: Mapping[str, float] | None = None,
    ) -> None:
        """Rebalance at run time; validated before anything changes (all or nothing)."""
        by_name = {s.name: pair for pair in self.scorers for s in [pair[0]]}
        updates = dict(scorer_weights or {})
        for n, v in updates.items():
            if n not in by_name:
                raise InvalidArgument("scorer_weights", f"no scorer named {n!r}")
            if v < 0:
                raise InvalidArgument("scorer_weights", "weights must be >= 0")
        if (prefill_weight is None) != (decode_weight is None):
            raise InvalidArgument("prefill_weight", "give both prefill_weight and decode_weight")
        if prefill_weight is not None and decode_weight is not None:
            if prefill_weight < 0 or decode_weight < 0 or prefill_weight + decode_weight <= 0:
                raise InvalidArgument("prefill_weight", "weights must be >= 0 and not both 0")
            touched = False
            for s, _ in self.scorers:
                if hasattr(s, "set_weights"):
                    s.set_weights(prefill_weight, decode_weight)
                    touched = True
            if "prefill-cost" in by_name:
                by_name["prefill-cost"][1] = float(prefill_weight)
                touched = True
            if "decode-load" in by_name:
                by_name["decode-load"][1] = float(decode_weight)
                touched = True
            if not touched:
                raise InvalidArgument("prefill_weight", f"profile {self.name!r} has no prefill/decode scorer")
        for n, v in updates.items():
            by_name[n][1] = float(v)

    def decide(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> Decision:
        """Run filters → scorers → picker over `workers` for `req`."""
        if not workers:
            return Decision(req.request_id, None, rejected_by="no-workers", picker=self.picker.name)
        cands: Sequence[WorkerView] = workers
        removed: dict[str, int] = {}
        for f in self.filters:
            out = f.filter(req, cands)
            if len(out) != len(cands):
                removed[f.name] = len(cands) - len(out)
                if not out:
                    return Decision(req.request_id, None, removed=removed, rejected_by=f.name, picker=self.picker.name)
            cands = out
        terms: dict[str, Sequence[float]] = {}
        totals: list[float]
        scorers = self.scorers
        if len(scorers) == 1 and scorers[0][1] == 1.0:
            s = scorers[0][0]
            totals = s.score(req, cands, workers)
            terms[s.name] = totals
        else:
            totals = [0.0] * len(cands)
            for s, wgt in scorers:
                vals = s.score(req, cands, workers)
                terms[s.name] = vals
                if wgt and any(vals):  # e.g. session affinity without a session: all zero, nothing to add
                    totals = [t + wgt * v for t, v in zip(totals, vals, strict=True)]
        i = self.picker.pick(req, cands, totals)
        d = Decision(
            req.request_id,
            cands[i].id,
            candidates=tuple([w.id for w in cands]),
            totals=totals,
            terms=terms,
            removed=removed,
            picker=self.picker.name,
        )
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s", d.to_log(), extra={"request_id": req.request_id})
        return d
