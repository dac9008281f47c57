"""kvmesh's vLLM KV connector: `connector` (the `KVConnectorBase_V1` subclass; imports vLLM), `plan` and
`layout` (pure), `blocks` (torch copies between the paged KV cache and a block buffer)."""
