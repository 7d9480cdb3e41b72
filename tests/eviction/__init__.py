"""Tests of eviction policies, retention hints and the host-memory tier."""
