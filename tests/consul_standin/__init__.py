"""STAND-IN for a Consul agent's HTTP API, for tests only (no Consul binary exists on these machines).

Run as a process: ``python -m tests.consul_standin --port 0`` prints ``{"port": N}`` once listening.
"""
