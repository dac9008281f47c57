"""kv-sync: RDMA-style movement of KV blocks (registered regions, one-sided read/write, CRC32C completion)."""
