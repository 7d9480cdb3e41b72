"""Simulator layer: trace-driven runs of the real scheduler and manager.

`inputs/` (traces, synthetic workloads, block keys, the future) feeds the run modes here
(`replay`, `eviction_replay`, `serve`, `memory_study`, with `cost_model` and `processes`);
`cluster/` runs N serve instances behind a router; `report/` turns any mode's results into
JSON, a table and a plot. Above the scheduler and below the CLI. Pure standard library;
`rich` and `matplotlib` are imported lazily by the report and plot helpers.
"""
