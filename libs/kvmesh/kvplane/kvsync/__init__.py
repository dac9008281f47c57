"""kv-sync: a worker's shared-memory KV tier (`tier`, pure), served to peers by KvSyncService (`service`),
pulled by `client.KvSyncClient.pull` over the best transport both sides offer (`transport`: one-sided from
shared memory on the same host, one-sided through Mooncake's Transfer Engine (`mooncake`) across hosts, else
gRPC; every block CRC32C-verified). `codec`: the ReadBlocks wire bytes; `peer`: a stand-alone peer for
benchmarks and tests."""
