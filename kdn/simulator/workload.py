"""Request streams: synthetic (Zipf documents, growing sessions, a daily cycle per region) and
replay of a Mooncake-format trace. Both produce the same compact :class:`Requests` (CSR arrays,
no per-request objects), so a million requests fit in a few tens of MB.

Chunk keys are ints here (the simulator's stand-in for ``ChunkKey``): request ``i`` reads the chain
``keys[key_off[i]:key_off[i+1]]``; only full chunks are keys, the tail is always recomputed.
Chains are prefixes: two requests that share a key share every key before it.

Synthetic key layout (int64): a document's chunk ``j`` is ``doc << 20 | j``; chunks past the
document's last full chunk belong to the request's *tail owner* (its session, or the single request
itself): ``TAIL_BASE + owner * 4096 + j``. Trace keys are the trace's hash ids.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kdn.errors import ConfigError
from kdn.simulator.scenario import MAX_TOKENS, Scenario, SyntheticWorkload, TraceWorkload
from kdn.simulator.topology import Topology

__all__ = ["Requests", "TAIL_BASE", "build_workload", "synthetic", "trace_replay"]

TAIL_BASE = 1 << 42
TAIL_SPAN = 4096  # chunks per tail owner in the synthetic key layout
DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class Requests:
    t: np.ndarray  # (n,) float64 arrival time, sorted
    edge: np.ndarray  # (n,) int64 edge site serving the request
    input_tokens: np.ndarray  # (n,) int64
    key_off: np.ndarray  # (n+1,) int64 CSR offsets into keys
    keys: np.ndarray  # (total_chunks,) int64
    hint_t: np.ndarray  # (h,) float64 sorted: when a prefetch hint for hint_req arrives
    hint_req: np.ndarray  # (h,) int64
    block_tokens: int
    origin_preloaded: bool  # documents were ingested at the origin before t=0
    duration_s: float

    def __len__(self) -> int:
        return len(self.t)

    def head(self, n: int) -> Requests:
        """The first ``n`` requests (and their hints)."""
        if n >= len(self):
            return self
        keep = self.hint_req < n
        return Requests(
            t=self.t[:n],
            edge=self.edge[:n],
            input_tokens=self.input_tokens[:n],
            key_off=self.key_off[: n + 1],
            keys=self.keys[: self.key_off[n]],
            hint_t=self.hint_t[keep],
            hint_req=self.hint_req[keep],
            block_tokens=self.block_tokens,
            origin_preloaded=self.origin_preloaded,
            duration_s=float(self.t[n - 1]) if n else 0.0,
        )

    def unique_chunks(self) -> int:
        return int(np.unique(self.keys).size)


def _arrivals(rng: np.random.Generator, n: int, duration_s: float, topo: Topology, amplitude: float) -> tuple[np.ndarray, np.ndarray]:
    """``n`` (time, edge) pairs, unsorted: each edge's rate is its user share times a daily cycle
    ``1 + amplitude * cos(2 pi (local hour - 14) / 24)`` (local solar time from the longitude,
    t = 0 is midnight UTC). Rejection sampling of the joint density, so both the mix of regions
    and the total rate follow the sun."""
    cdf = np.cumsum(topo.edge_users)
    cdf[-1] = 1.0
    t_out = np.empty(n)
    e_out = np.empty(n, dtype=np.int64)
    filled = 0
    while filled < n:
        m = max(1024, int((n - filled) * 1.2 * (1 + amplitude)))
        t = rng.random(m) * duration_s
        e = np.minimum(np.searchsorted(cdf, rng.random(m), side="right"), len(cdf) - 1)
        local_h = (t / 3600.0 + topo.edge_lon[e] / 15.0) % 24.0
        f = 1.0 + amplitude * np.cos(2 * np.pi * (local_h - 14.0) / 24.0)
        ok = np.flatnonzero(rng.random(m) * (1.0 + amplitude) <= f)[: n - filled]
        t_out[filled : filled + ok.size] = t[ok]
        e_out[filled : filled + ok.size] = e[ok]
        filled += ok.size
    return t_out, e_out


def _build_csr(
    doc: np.ndarray, doc_full: np.ndarray, owner: np.ndarray, full: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Keys for requests with ``full`` chunks, the first ``doc_full`` from document ``doc``."""
    off = np.zeros(len(full) + 1, dtype=np.int64)
    np.cumsum(full, out=off[1:])
    req = np.repeat(np.arange(len(full)), full)
    j = np.arange(off[-1], dtype=np.int64) - off[:-1][req]
    keys = np.where(j < doc_full[req], (doc[req] << 20) | j, TAIL_BASE + owner[req] * TAIL_SPAN + j)
    return off, keys


def synthetic(w: SyntheticWorkload, topo: Topology, block_tokens: int, seed: int) -> Requests:
    rng = np.random.default_rng(seed)
    B = block_tokens
    D = w.documents
    ranks = np.arange(1, D + 1, dtype=np.float64)
    zipf_cdf = np.cumsum(ranks ** -w.zipf_s)
    zipf_cdf /= zipf_cdf[-1]
    doc_tokens = np.minimum(
        np.maximum(rng.lognormal(np.log(w.doc_tokens_median), w.doc_tokens_sigma, D), 1), w.doc_tokens_max
    ).astype(np.int64)
    region_offset = rng.integers(0, D, size=len(topo.region_names))

    def draw_docs(edges: np.ndarray) -> np.ndarray:
        rank = np.minimum(np.searchsorted(zipf_cdf, rng.random(edges.size)), D - 1)
        local = rng.random(edges.size) < w.regional_locality
        return np.where(local, (rank + region_offset[topo.edge_region[edges]]) % D, rank)

    n = w.requests
    n_sess_target = int(round(n * w.session_fraction))
    # Sessions: start uniformly, turns spaced by exponential think times, context grows per turn.
    s_t: list[np.ndarray] = []
    s_id: list[np.ndarray] = []
    s_turn: list[np.ndarray] = []
    n_sessions = 0
    if n_sess_target:
        n_sessions = max(1, int(round(n_sess_target / w.session_turns_mean)))
        turns = 1 + rng.poisson(w.session_turns_mean - 1, n_sessions)
        start, sess_edge = _arrivals(rng, n_sessions, w.duration_s, topo, w.diurnal_amplitude)
        sid = np.repeat(np.arange(n_sessions), turns)
        toff = np.zeros(n_sessions + 1, dtype=np.int64)
        np.cumsum(turns, out=toff[1:])
        turn_idx = np.arange(toff[-1]) - toff[:-1][sid]
        gaps = rng.exponential(w.think_time_s, toff[-1])
        gaps[toff[:-1]] = 0.0
        cum = np.cumsum(gaps)
        t_turn = start[sid] + cum - cum[toff[:-1]][sid]
        keep = t_turn < w.duration_s
        if keep.sum() > n_sess_target:
            idx = np.flatnonzero(keep)
            drop = rng.choice(idx, size=idx.size - n_sess_target, replace=False)
            keep[drop] = False
        s_t.append(t_turn[keep])
        s_id.append(sid[keep])
        s_turn.append(turn_idx[keep])
    st = np.concatenate(s_t) if s_t else np.zeros(0)
    sid = np.concatenate(s_id).astype(np.int64) if s_id else np.zeros(0, dtype=np.int64)
    sturn = np.concatenate(s_turn).astype(np.int64) if s_turn else np.zeros(0, dtype=np.int64)
    n_single = n - st.size
    single_t, single_edge = _arrivals(rng, n_single, w.duration_s, topo, w.diurnal_amplitude)
    # Sessions keep their edge and document for all turns.
    if not n_sessions:
        sess_edge = np.zeros(0, dtype=np.int64)
    sess_doc = draw_docs(sess_edge) if n_sessions else np.zeros(0, dtype=np.int64)
    single_doc = draw_docs(single_edge)

    t = np.concatenate([single_t, st])
    edge = np.concatenate([single_edge, sess_edge[sid]])
    doc = np.concatenate([single_doc, sess_doc[sid]])
    owner = np.concatenate([n_sessions + np.arange(n_single), sid])
    extra = np.concatenate([np.zeros(n_single, dtype=np.int64), sturn * w.turn_tokens])
    tokens = doc_tokens[doc] + w.query_tokens + extra
    order = np.argsort(t, kind="stable")
    t, edge, doc, owner, tokens = t[order], edge[order], doc[order], owner[order], tokens[order]
    full = tokens // B
    if full.size and int(full.max()) > TAIL_SPAN:
        raise ConfigError(
            f"workload: a request spans {int(full.max()):,} chunks of block_tokens={B}; the synthetic workload allows at most "
            f"{TAIL_SPAN:,} (raise block_tokens, or lower doc_tokens_max, query_tokens, turn_tokens or session_turns_mean)"
        )
    off, keys = _build_csr(doc, doc_tokens[doc] // B, owner, full)
    hint_t, hint_req = _hints(rng, t, w.hint_coverage, w.hint_lead_s)
    return Requests(t, edge, tokens, off, keys, hint_t, hint_req, B, True, w.duration_s)


def _hints(rng: np.random.Generator, t: np.ndarray, coverage: float, lead_s: float) -> tuple[np.ndarray, np.ndarray]:
    if coverage <= 0 or t.size == 0:
        return np.zeros(0), np.zeros(0, dtype=np.int64)
    req = np.flatnonzero(rng.random(t.size) < coverage)
    ht = np.maximum(t[req] - lead_s, 0.0)
    order = np.argsort(ht, kind="stable")
    return ht[order], req[order]


_INT64 = (-(1 << 63), (1 << 63) - 1)


def _number(rec: dict, key: str, *, integer: bool) -> float:
    if key not in rec:
        raise ValueError(f"missing field {key!r}")
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, int | float) or (integer and not isinstance(v, int)):
        raise ValueError(f"{key}: expected {'an integer' if integer else 'a number'}, got {v!r}")
    if not math.isfinite(v) or v < 0 or (integer and v > MAX_TOKENS):
        raise ValueError(f"{key}: out of range, got {v!r}")
    return v


def _trace_record(line: str) -> tuple[float, int, list[int]]:
    """One trace line as (timestamp ms, input tokens, hash ids); ValueError names what is wrong."""
    rec = json.loads(line)
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    ts = _number(rec, "timestamp", integer=False)
    n_in = int(_number(rec, "input_length", integer=True))
    ids = rec.get("hash_ids")
    if not isinstance(ids, list) or not all(type(h) is int and _INT64[0] <= h <= _INT64[1] for h in ids):
        raise ValueError(f"hash_ids: expected a list of 64-bit integers, got {str(ids)[:80]}")
    return ts, n_in, ids


def _trace_lines(path: Path) -> Iterator[str]:
    """The trace's lines, gunzipped when it is gzip-compressed."""
    with path.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"
    with (gzip.open(path, "rt", encoding="utf-8") if gz else path.open(encoding="utf-8")) as f:
        yield from f


def trace_replay(w: TraceWorkload, topo: Topology, seed: int) -> Requests:
    """Replay a Mooncake-format JSONL trace; a conversation (its first two hash ids) keeps one edge."""
    rng = np.random.default_rng(seed)
    B = w.trace_block_tokens
    ts: list[float] = []
    tokens: list[int] = []
    chains: list[list[int]] = []
    roots: list[int] = []
    path = Path(w.path)
    lineno = 1  # the line being read
    try:
        for line in _trace_lines(path):
            if w.limit is not None and len(ts) >= w.limit:
                break
            if line.strip():
                t_ms, n_in, ids = _trace_record(line)
                ts.append(t_ms / 1000.0 / w.time_scale)
                tokens.append(n_in)
                chains.append(ids[: n_in // B])
                # A conversation is named by its first block after the shared system prompt.
                roots.append(ids[1] if len(ids) > 1 else (ids[0] if ids else -len(ts)))
            lineno += 1
    except (OSError, EOFError, zlib.error, ValueError) as exc:
        raise ConfigError(f"workload.path: cannot read trace {path} (line {lineno}): {exc}") from exc
    if not ts:
        raise ConfigError(f"workload.path: trace {path} holds no requests")
    t = np.asarray(ts)
    order = np.argsort(t, kind="stable")
    t = t[order]
    tok = np.asarray(tokens, dtype=np.int64)[order]
    chains = [chains[i] for i in order]
    uniq, inv = np.unique(np.asarray(roots, dtype=np.int64)[order], return_inverse=True)
    cdf = np.cumsum(topo.edge_users)
    cdf[-1] = 1.0
    root_edge = np.minimum(np.searchsorted(cdf, rng.random(uniq.size), side="right"), len(cdf) - 1)
    edge = root_edge[inv].astype(np.int64)
    full = np.asarray([len(c) for c in chains], dtype=np.int64)
    off = np.zeros(len(full) + 1, dtype=np.int64)
    np.cumsum(full, out=off[1:])
    keys = np.fromiter((h for c in chains for h in c), dtype=np.int64, count=int(off[-1]))
    hint_t, hint_req = _hints(rng, t, w.hint_coverage, w.hint_lead_s)
    return Requests(t, edge, tok, off, keys, hint_t, hint_req, B, False, float(t[-1]) if t.size else 0.0)


def build_workload(sc: Scenario, topo: Topology) -> Requests:
    w = sc.workload
    if isinstance(w, TraceWorkload):
        return trace_replay(w, topo, sc.seed)
    return synthetic(w, topo, sc.block_tokens, sc.seed)
