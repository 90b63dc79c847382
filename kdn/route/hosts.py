"""One inference host as the router sees it: health, load, measured rates, a soft record.

Everything here is rebuilt from the host itself: health from its ``/health`` and ``/v1/models``,
rates from measurements (:mod:`kdn.route.rates`), load from the requests this router has in flight
there. :class:`EngineRecord` remembers which chain keys were recently routed to the host (so are in
its engine's own KV cache, or about to be), bounded in tokens and age; a router that restarts has
an empty record and learns it again from the edges and the next requests, losing only speed.

Health: a host is ``up`` after a check that answered 200 on ``/health`` and showed a vLLM model
list on ``/v1/models``; ``not_vllm`` when something else answers there; ``down`` after
``fail_after`` consecutive failed checks or forwards. Only ``up`` hosts are routed to.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Sequence

from kdn.route.config import HostSpec
from kdn.route.edges import EdgeView
from kdn.route.rates import LinkRates, PrefillFit

__all__ = ["Host", "EngineRecord", "InFlight", "Predictions", "Queued", "Status"]

Status = Literal["starting", "up", "down", "not_vllm"]
_ids = itertools.count(1)


class EngineRecord:
    """Chain keys recently routed to one host, newest last; at most ``max_tokens`` tokens' worth,
    each believed for ``max_age_s``."""

    def __init__(self, max_tokens: int, max_age_s: float) -> None:
        self.max_tokens = max_tokens
        self.max_age_s = max_age_s
        self._keys: OrderedDict[bytes, tuple[float, int]] = OrderedDict()
        self._tokens = 0

    def add(self, keys: Sequence[bytes], tokens_each: int, now: float) -> None:
        if self.max_tokens <= 0:
            return
        for k in keys:
            old = self._keys.pop(bytes(k), None)
            if old is not None:
                self._tokens -= old[1]
            self._keys[bytes(k)] = (now, tokens_each)
            self._tokens += tokens_each
        while self._tokens > self.max_tokens and self._keys:
            _, (_, n) = self._keys.popitem(last=False)
            self._tokens -= n

    def leading(self, keys: Sequence[bytes], now: float) -> int:
        n = 0
        for k in keys:
            got = self._keys.get(bytes(k))
            if got is None or now - got[0] > self.max_age_s:
                break
            n += 1
        return n

    def clear(self) -> None:
        self._keys.clear()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._keys)


class Predictions:
    """How far this host's predicted TTFTs were from its streamed first bytes, over the last
    ``keep`` requests: where a cost router's picks go wrong, the error says which part (queue,
    fetch, prefill) it mispriced."""

    def __init__(self, keep: int = 256) -> None:
        self._rows: deque[tuple[float, float, float, float, float]] = deque(maxlen=keep)

    def observe(self, predicted_s: float, observed_s: float, queue_s: float, fetch_s: float, prefill_s: float) -> None:
        self._rows.append((predicted_s, observed_s, queue_s, fetch_s, prefill_s))

    def as_dict(self) -> dict[str, float]:
        rows = list(self._rows)
        if not rows:
            return {"n": 0}
        err = [o - p for p, o, *_ in rows]
        mean = lambda i: statistics.fmean(r[i] for r in rows)  # noqa: E731
        return {"n": len(rows), "median_error_s": statistics.median(err),
                "median_abs_error_s": statistics.median(abs(e) for e in err),
                "mean_predicted_s": mean(0), "mean_observed_s": mean(1),
                "mean_queue_s": mean(2), "mean_fetch_s": mean(3), "mean_prefill_s": mean(4)}


class Queued(NamedTuple):
    """The requests sent to a host and not yet answered, summed."""

    tokens: float  # their prefill tokens
    link_s: float  # their predicted link time
    requests: int
    load_bytes: float  # bytes of KV they load from the edge


@dataclass(slots=True)
class InFlight:
    """One forwarded request: its prefill tokens count as queued at the host until its first byte
    (a streamed answer) or its predicted first token (an answer that is not streamed)."""

    id: int
    prefill_tokens: int
    link_s: float  # predicted link time of its loads from the edge
    sent: float
    predicted_ttft_s: float
    stream: bool
    load_bytes: int = 0  # bytes of KV it loads from the edge
    first_byte: float | None = None

    def queued(self, now: float) -> bool:
        if self.first_byte is not None:
            return False
        return self.stream or now < self.sent + self.predicted_ttft_s


@dataclass(slots=True)
class Host:
    spec: HostSpec
    edge: EdgeView | None
    fit: PrefillFit
    links: LinkRates
    record: EngineRecord
    status: Status = "starting"
    error: str = ""
    failures: int = 0
    model_id: str = ""
    calibrated: bool = False
    active: dict[int, InFlight] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=lambda: {
        "routed": 0, "failed": 0, "first_bytes": 0, "lookup_errors": 0, "health_failures": 0})
    edge_counters: dict[str, float] | None = None
    predictions: Predictions = field(default_factory=lambda: Predictions())

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def usable(self) -> bool:
        return self.status == "up"

    def queued(self, now: float | None = None) -> Queued:
        """What was sent here and is not yet answered."""
        now = time.monotonic() if now is None else now
        waiting = [r for r in self.active.values() if r.queued(now)]
        return Queued(float(sum(r.prefill_tokens for r in waiting)), sum(r.link_s for r in waiting), len(waiting),
                      float(sum(r.load_bytes for r in waiting)))

    def begin(self, prefill_tokens: int, link_s: float, predicted_ttft_s: float, stream: bool,
              load_bytes: int = 0) -> InFlight:
        r = InFlight(next(_ids), prefill_tokens, link_s, time.monotonic(), predicted_ttft_s, stream, load_bytes)
        self.active[r.id] = r
        self.counters["routed"] += 1
        return r

    def end(self, r: InFlight) -> None:
        self.active.pop(r.id, None)

    def failed_check(self, why: str, fail_after: int) -> None:
        self.failures += 1
        self.error = why
        if self.failures >= fail_after and self.status != "down":
            self.status = "down"
            self.record.clear()  # its engine may have restarted: nothing is believed held there

    def passed_check(self) -> None:
        self.failures = 0
        self.error = ""

    def describe(self) -> dict[str, object]:
        now = time.monotonic()
        return {"name": self.name, "url": self.spec.url, "edge": self.spec.edge, "status": self.status,
                "error": self.error, "model": self.model_id, "in_flight": len(self.active),
                "queued_tokens": self.queued(now).tokens, "prefill": self.fit.as_dict(), "links": self.links.as_dict(),
                "engine_record_keys": len(self.record), "counters": dict(self.counters),
                "predictions": self.predictions.as_dict()}
