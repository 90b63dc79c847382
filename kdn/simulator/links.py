"""Links that queue: each site has one egress link, served first come first served.

A transfer that becomes ready at ``ready`` on a link busy until ``busy`` starts at
``max(ready, busy)`` and holds the link for ``nbytes / bandwidth``; that is the Lindley recursion of a
FIFO queue, so a transfer's finish time is known the moment it is committed and needs no event.
Predicting (``finish``) and committing (``commit``) give the same number as long as nothing else is
committed in between, which is what lets the fetch-or-recompute rule use exact predictions.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Links"]


class Links:
    __slots__ = ("busy", "bw", "sent_bytes")

    def __init__(self, bandwidth_Bps: Sequence[float]) -> None:
        self.bw = [float(b) for b in bandwidth_Bps]
        self.busy = [0.0] * len(self.bw)
        self.sent_bytes = [0.0] * len(self.bw)

    def finish(self, site: int, ready: float, nbytes: float) -> float:
        """When the last byte would leave ``site``'s link, without taking the link."""
        b = self.busy[site]
        return (b if b > ready else ready) + nbytes / self.bw[site]

    def commit(self, site: int, ready: float, nbytes: float) -> float:
        """Queue the transfer on the link; returns when its last byte leaves."""
        b = self.busy[site]
        end = (b if b > ready else ready) + nbytes / self.bw[site]
        self.busy[site] = end
        self.sent_bytes[site] += nbytes
        return end
