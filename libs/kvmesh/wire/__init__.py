"""kvmesh's wire formats besides the generated protobuf code (`kvmesh.v1`), one module each.

- `vllm_events`: vLLM's KV-event structs and frame codec (pure).
- `zmq_subscriber`: the one SUB + DEALER-replay follower of a vLLM-format publisher.
- `proto`: every proto <-> domain conversion (pure).
- `frames`: generate frames, the opt-in router → worker transport without HTTP/2 (pure codec).
- `ingest_log`: the cache-manager's compact msgpack log and checkpoint records (pure).
- `token_ids`: a prompt's token ids as the router keeps them, a uint32 array with its `TokenIds` bytes.
"""
