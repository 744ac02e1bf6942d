"""Real engines: replay against vLLM's own scheduler (vLLM imported lazily)."""
