"""The replica model: continuous batching over a paged KV cache, timed by ``perf``."""
