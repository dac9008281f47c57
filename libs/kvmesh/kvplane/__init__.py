"""The KV data plane: `kvsync` (tier regions, leases, integrity, the transports that move blocks between
workers and zones) and `vllm_connector` (vLLM's KV connector over a worker's tier region)."""
