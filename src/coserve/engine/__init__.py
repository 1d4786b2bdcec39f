"""vLLM adapters of coserve: scheduler, safepoint worker, KV connector, request validation."""
