"""Names vulture reports unused that are used where it can't see (scripts/check_dead_code.sh). Reviewed by hand.

Each group starts with a one-word reason. Add a name only when it is used by something vulture does not read
(a framework calling it by name, a wire format, a test); delete dead code instead.
"""

# ruff: noqa: B018, F821

# vllm: general plugins vLLM loads by entry point (pyproject.toml, vllm.general_plugins)
_.die_with_worker

# grpc: servicer methods and interceptor hooks that grpc calls by name
_.Rebalance
_.ListWorkers
_.DrainWorker
_.GenerateStream
_.Abort
_.StreamKvEvents
_.WarmPrefixes
_.SetWarmingPolicy
_.Checkpoint
_.Restore
_.GetStats
_.SetTrafficWeights
_.GetTrafficWeights
_.RollbackTrafficWeights
_.GetZoneHealth
_.StartRollout
_.GetRollout
_.RegisterRegion
_.DeregisterRegion
_.intercept_unary_unary
_.intercept_unary_stream
_.intercept_stream_unary
_.intercept_stream_stream
_.intercept_service

# vllm: LogitsProcessor, what vLLM calls on kvmesh.engine.vllm_grammar (loaded by its qualified name)
ResumedGrammar
is_pin_memory
_.validate_params
_.is_argmax_invariant
_.update_state

# vllm: KVConnectorBase_V1 / KVConnectorStats, what vLLM calls on kvmesh.kvplane.vllm_connector (by module path)
KvmeshConnector
_.add_events  # KVConnectorKVEvents
_.aggregate
attn_metadata
_.build_connector_meta
_.build_kv_connector_stats
forward_context
_.clear_events
_.get_block_ids_with_load_errors
_.get_kv_connector_kv_cache_events
_.get_kv_connector_stats
_.get_num_new_matched_tokens
_.get_number_of_workers
_.increment_workers
_.is_empty
kv_layer
layer_name
_.reduce
_.register_kv_caches
_.request_finished
_.requires_kv_delivery
_.save_kv_layer
_.start_load_kv
_.take_events
_.update_connector_output
_.update_state_after_alloc
_.wait_for_layer_load
_.wait_for_save

# vllm: vLLM's stat-logger protocol (method, arguments) and engine-args attributes vLLM reads
_.log_engine_initialized
engine_idx
mm_cache_stats
_.enable_prefix_caching
_.disable_log_stats
_.kv_events_config

# wire: msgspec struct fields that decode vLLM's positional arrays; LoadReport fields that
# kvmesh.wire.proto copies to and from the proto by name
lora_id
_.kv_blocks_used

# library: attributes a third-party object reads (tokenizers)
_.pre_tokenizer

# record: fields of a published record, set by producers; readers pick the ones they need
nominal_bytes
zone_generation
version_generation
worker_capacity_up
worker_capacity_total
zone_healthy
restarts
duplicates

# tests: public API and stats counters that tests exercise (no production caller yet)
_.pending_resyncs
_.uses_vllm_classes
_.replays
_.replay_failures
_.attempts_total
_.set_zone_weights
_.set_version_weights
_.rollback_versions
canary_step
next_upgrade_pct
_.cached_hashes
_.aborted
aborted
bursty
multi_turn_sessions
long_context_mix
_.iter_pairs
KvSyncClient
_.read_blocks
_.write_blocks
_.evict
KvSyncServicer
_.is_running
_.trips
_.retry_in
_.worker_of
_.enabled
_.fallbacks
bad_request_fields
ServiceInterceptor
_.exc_text  # logging.LogRecord's cached traceback text, cleared by rpc.server.QuietClientErrors
_.kv_connector_counts  # VllmEngine's connector counters, read by the real-vLLM connector tests
current_identity  # kvmesh.security.identity: the handlers' read of the caller (tests; the role checks inside services)
_.connection_made  # asyncio.Protocol callbacks (generate frames on both sides), called by the event loop
_.data_received
_.pause_writing
_.resume_writing
_.connection_lost
_.candidate  # kvmesh.fleet.pd_eval.Searched: the split or step budget an outcome belongs to (read in reports and tests)
_.get_finished  # vLLM's KV connector API (KVConnectorBase_V1), called by vLLM's scheduler and worker
_.handle_preemptions
_.rss_mb  # kvmesh.bench.chaos_runner.Sample: read by name in chaos_report's growth figures
_.kernel_block_ids  # kvmesh.kvplane.vllm_connector: the block <-> kernel block and TP rank maps (tests; the docs)
with_rank
_.buffered_blocks  # services.worker.kvlog.KvEventLog: the replay buffer's size in blocks (tests read it)
