"""The routing proxy: prefill, the first token streamed at once, then decode."""
