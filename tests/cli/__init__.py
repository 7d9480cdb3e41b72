"""Tests of the `pagedkv` commands end to end."""
