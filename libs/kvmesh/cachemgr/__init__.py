"""Cache-manager logic that is not the index itself: event ingestion, resync, vLLM ZMQ intake, checkpoints."""
