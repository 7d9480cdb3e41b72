"""Simulator report layer: every mode's report as a JSON-ready dict, its terminal table, its
plot, and the profile list; above the run modes, whose result types it reads.

`format` holds what all reports share; `replay`, `serve`, `memory`, `eviction` and `cluster`
one mode each; `render` prints any of them; `plot` draws them (matplotlib, imported lazily).
"""

from pagedkv.sim.report.cluster import cluster_report, render_cluster_text
from pagedkv.sim.report.eviction import eviction_report, gap_closed, plot_eviction
from pagedkv.sim.report.format import REPORT_FORMAT, Speed, kv_cache_groups_report, to_json
from pagedkv.sim.report.memory import memory_report
from pagedkv.sim.report.plot import plot_memory, plot_replay, plot_serve
from pagedkv.sim.report.profiles import render_profiles
from pagedkv.sim.report.render import print_report, render_rich, render_text
from pagedkv.sim.report.replay import replay_report
from pagedkv.sim.report.serve import serve_report

__all__ = [
    "REPORT_FORMAT",
    "Speed",
    "cluster_report",
    "eviction_report",
    "gap_closed",
    "kv_cache_groups_report",
    "memory_report",
    "plot_eviction",
    "plot_memory",
    "plot_replay",
    "plot_serve",
    "print_report",
    "render_cluster_text",
    "render_profiles",
    "render_rich",
    "render_text",
    "replay_report",
    "serve_report",
    "to_json",
]
