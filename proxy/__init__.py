"""The routing proxy (prefill, first token streamed at once, then decode) and the pool launcher."""
