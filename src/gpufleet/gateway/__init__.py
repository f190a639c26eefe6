"""The OpenAI-compatible HTTP edge: proxy, auth, streaming, metrics."""
