"""lmcache-pd: push a prompt's KV cache from a prefill vLLM instance into a decode instance."""
