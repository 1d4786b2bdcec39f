"""KV offload policy: block identity, the bounded host pool, the copy budget, settings (pure Python)."""
