"""Simulator layer: traces, synthetic workloads, the cost model, replay and serve modes.

Above the scheduler and below the CLI. Pure standard library; `rich` and `matplotlib` are
imported lazily by the report and plot helpers.
"""
