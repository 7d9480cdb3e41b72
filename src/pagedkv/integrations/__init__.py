"""Integrations: pagedkv inside other inference engines (each behind its own extra).

`pagedkv.integrations.vllm` runs vLLM's own `Scheduler` on pagedkv's KV-cache manager. Nothing
below this package imports it.
"""
