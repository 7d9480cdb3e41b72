"""Tests of the simulator: traces, workloads, replay, serve, memory study, cluster."""
