"""pagedkv's test suite: one subpackage per area, shared helpers in `support`."""
