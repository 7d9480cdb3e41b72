"""Tests of block-residency metrics and the Prometheus export."""
