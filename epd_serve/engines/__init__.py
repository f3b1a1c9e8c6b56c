"""One vLLM engine process: the HAL that builds it, KV protocols, its counters and flags, a tiny model."""
