"""Pickers: choose one candidate from the combined costs (one module per picker, baselines included)."""

from kvmesh.routing.pickers.least_loaded import LeastLoadedPicker
from kvmesh.routing.pickers.min_cost import MinCostPicker
from kvmesh.routing.pickers.random_pick import RandomPicker
from kvmesh.routing.pickers.round_robin import RoundRobinPicker

__all__ = ["LeastLoadedPicker", "MinCostPicker", "RandomPicker", "RoundRobinPicker"]
