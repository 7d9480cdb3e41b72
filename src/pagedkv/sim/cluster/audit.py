"""Simulator layer: the audit of a cluster run's routing (`ClusterConfig.audit_index`): every
decision made on the router's index is checked against the truth, an index fed by the
publishers themselves as they publish."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.router import IndexUnavailableError, InMemoryPrefixIndex


class RoutingAudit:
    """The truth as of the batches published (an index fed by the publishers, not the wire)
    and the count of routing decisions whose scores disagreed with it."""

    def __init__(self) -> None:
        self.truth = InMemoryPrefixIndex()
        self.num_decisions = 0
        self.num_phantom = 0
        self.num_inexact = 0
        self.num_contents_checks = 0
        self.num_contents_mismatches = 0
        self.seen_recoveries = 0

    def check(self, block_hashes: Sequence[Any], lengths: Mapping[str, int]) -> None:
        true = self.truth.match_lengths(block_hashes, lengths)
        self.num_decisions += 1
        self.num_phantom += any(lengths[i] > true[i] for i in lengths)
        self.num_inexact += lengths != true

    def check_contents(self, index: Any, instances: Sequence[Any]) -> None:
        """Compare the whole index with the truth (skipped while the index is unreadable)."""
        try:
            contents = {i.instance_id: index.instance_contents(i.instance_id) for i in instances}
        except IndexUnavailableError:
            return
        self.num_contents_checks += 1
        truth = self.truth
        self.num_contents_mismatches += any(
            contents[i] != truth.instance_contents(i) for i in contents
        )

    def summary(self) -> dict[str, int]:
        return {
            "decisions_on_index": self.num_decisions,
            "phantom_hit_decisions": self.num_phantom,
            "inexact_decisions": self.num_inexact,
            "contents_checks": self.num_contents_checks,
            "contents_mismatches": self.num_contents_mismatches,
        }
