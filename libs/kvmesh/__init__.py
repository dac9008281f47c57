"""kvmesh: KV-cache-aware, load-aware serving of LLMs across a fleet of vLLM workers."""

__version__ = "0.1.0"
