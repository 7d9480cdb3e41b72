"""Tests of pagedkv inside vLLM, call for call against vLLM's own manager."""
