"""Synthetic KV-reuse traces with different reuse structure, in the Mooncake trace's shape (each
request: input tokens and the chain of 512-token block ids it reads), for eviction benchmarks.

``documents``      RAG: Zipf-popular documents (chains of 2-40 blocks) behind a short shared
                   system prompt, a unique query block each; reuse by popularity, long distances.
``conversations``  chat: sessions of 3-12 turns, each turn's chain extends the previous one by
                   1-3 blocks; many sessions interleaved; reuse at think-time distances.
``agents``         agent loops: a few long tool/system prompts (16-48 blocks) shared by all runs of
                   an agent type; each run takes 5-30 quick steps that extend its own chain by a
                   block; short and very frequent reuse.
``scans``          a hot set of small documents mixed with a cyclic scan over a large set of cold
                   documents (the loop is longer than any cache): recency alone keeps the scan.
``coding``         coding assistants: a few repositories (20-60 blocks) shared by many sessions;
                   each session branches off its repository at an edited file and grows quickly.
``fewshot``        a few long prompt templates shared by all requests, each followed by a unique
                   one-off question of 1-4 blocks: one-off tails pollute recency.
``drift``          RAG whose popularity ranking moves: every 2,000 requests a fifth of the hot
                   documents is replaced by unseen ones; yesterday's hot set is stale.
``bursts``         news-like: each document is hot for a short burst after it appears, then
                   never read again; recency is all that counts.
``mixed``          two tenants interleaved: a chat service (``conversations``' shape) and a RAG
                   service (``documents``' shape) on one cache.
``longchat``       few, long conversations (10-40 turns, 1-3 blocks a turn, far apart):
                   long chains, reuse distances longer than small caches reach.

Each generator is deterministic in its seed. Block ids are ints, unique per distinct prefix.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = [
    "HELD_OUT", "TraceRequest", "TRACES", "agents", "bursts", "coding", "conversations", "documents", "drift", "fewshot",
    "longchat", "mixed", "scans",
]

BLOCK = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    input_length: int
    hash_ids: tuple[int, ...]


class _Ids:
    def __init__(self) -> None:
        self._next = itertools.count(1)

    def new(self, n: int) -> tuple[int, ...]:
        return tuple(next(self._next) for _ in range(n))


def _zipf(rng: np.random.Generator, n: int, s: float, size: int) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** s
    return rng.choice(n, size=size, p=p / p.sum())


Chain = tuple[int, ...]


def _req(chain: Chain, extra_tokens: int) -> TraceRequest:
    return TraceRequest(len(chain) * BLOCK + extra_tokens, chain)


def _sessions(
    n: int,
    rng: np.random.Generator,
    opens: Callable[[int], bool],
    start: Callable[[], tuple[Chain, int]],
    turn: Callable[[], Chain],
    extra_tokens: int,
    ask: Callable[[], Chain] = tuple,
) -> list[TraceRequest]:
    """``n`` requests of interleaved sessions. Before each request, a new session ``start()``
    (its first chain and its number of turns) joins when ``opens(number of live sessions)``; then
    a live session drawn at random asks for its chain plus ``ask()`` and, unless that was its last
    turn, its chain grows by ``turn()``. Every draw is from ``rng``, in that order."""
    live: list[tuple[Chain, int]] = []
    out = []
    while len(out) < n:
        if opens(len(live)):
            live.append(start())
        k = int(rng.integers(len(live)))
        chain, left = live[k]
        out.append(_req(chain + ask(), extra_tokens))
        if left <= 1:
            live.pop(k)
        else:
            live[k] = (chain + turn(), left - 1)
    return out


def documents(n: int = 20_000, seed: int = 1) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.new(2)
    n_docs = 3_000
    lengths = np.clip(rng.lognormal(np.log(10), 0.7, n_docs).astype(int), 2, 40)
    docs = [system + ids.new(int(k)) for k in lengths]
    out = []
    for d in _zipf(rng, n_docs, 0.9, n).tolist():
        out.append(_req(docs[d] + ids.new(1), 200))
    return out


def _chats(n: int, seed: int, *, system_blocks: int, most_live: int, p_open: float, first: tuple[int, int],
           turns: tuple[int, int], extra_tokens: int) -> list[TraceRequest]:
    """Chat sessions behind one system prompt: while fewer than ``most_live`` are live, a new one
    opens before a request with probability ``p_open`` (always when none is); it starts with
    ``first`` blocks and lasts ``turns`` turns (``[low, high)`` ranges), each turn adding 1-3 blocks."""
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.new(system_blocks)
    return _sessions(
        n, rng, lambda m: not m or (m < most_live and rng.random() < p_open),
        lambda: (system + ids.new(int(rng.integers(*first))), int(rng.integers(*turns))),
        lambda: ids.new(int(rng.integers(1, 4))), extra_tokens,
    )  # fmt: skip


def conversations(n: int = 20_000, seed: int = 2) -> list[TraceRequest]:
    return _chats(n, seed, system_blocks=3, most_live=200, p_open=0.35, first=(1, 4), turns=(3, 13), extra_tokens=300)


def agents(n: int = 20_000, seed: int = 3) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompts = [ids.new(int(rng.integers(16, 49))) for _ in range(6)]

    def start() -> tuple[Chain, int]:
        p = prompts[int(_zipf(rng, len(prompts), 1.0, 1)[0])]
        return p + ids.new(1), int(rng.integers(5, 31))

    return _sessions(n, rng, lambda m: m < 24 and (not m or rng.random() < 0.2), start, lambda: ids.new(1), 100)


def scans(n: int = 20_000, seed: int = 4) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    hot = [ids.new(int(rng.integers(2, 6))) for _ in range(150)]
    cold = [ids.new(int(rng.integers(2, 6))) for _ in range(4_000)]
    out = []
    pos = 0
    for _ in range(n):
        if rng.random() < 0.5:
            out.append(_req(hot[int(_zipf(rng, len(hot), 0.8, 1)[0])], 100))
        else:
            out.append(_req(cold[pos % len(cold)], 100))
            pos += 1
    return out


def coding(n: int = 20_000, seed: int = 5) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.new(2)
    repos = [system + ids.new(int(rng.integers(20, 61))) for _ in range(12)]

    def start() -> tuple[Chain, int]:
        repo = repos[int(_zipf(rng, len(repos), 1.1, 1)[0])]
        cut = int(rng.integers(len(repo) // 3, len(repo) + 1))  # the edited file: the rest differs
        return repo[:cut] + ids.new(int(rng.integers(1, 6))), int(rng.integers(4, 25))

    return _sessions(
        n, rng, lambda m: not m or (m < 60 and rng.random() < 0.15), start, lambda: ids.new(int(rng.integers(1, 3))), 250
    )


def fewshot(n: int = 20_000, seed: int = 6) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    templates = [ids.new(int(rng.integers(8, 25))) for _ in range(40)]
    out = []
    for t in _zipf(rng, len(templates), 1.2, n).tolist():
        out.append(_req(templates[t] + ids.new(int(rng.integers(1, 5))), 150))
    return out


def drift(n: int = 20_000, seed: int = 7) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.new(2)

    def doc() -> tuple[int, ...]:
        return system + ids.new(int(np.clip(rng.lognormal(np.log(8), 0.6), 2, 30)))

    hot = [doc() for _ in range(400)]
    out = []
    for i in range(n):
        if i and i % 2_000 == 0:
            for j in rng.choice(len(hot), size=len(hot) // 5, replace=False).tolist():
                hot[j] = doc()
        d = hot[int(_zipf(rng, len(hot), 0.9, 1)[0])]
        out.append(_req(d + ids.new(1), 200))
    return out


def bursts(n: int = 20_000, seed: int = 8) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    ids = _Ids()
    system = ids.new(1)
    return _sessions(
        n, rng, lambda m: m < 30 and (not m or rng.random() < 0.3),
        lambda: (system + ids.new(int(rng.integers(3, 16))), int(rng.integers(2, 40))),
        tuple, 120, ask=lambda: ids.new(1),
    )  # fmt: skip


def mixed(n: int = 20_000, seed: int = 9) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    chat = conversations(n, seed + 100)
    rag = documents(n, seed + 200)
    offset = 1 << 30  # the two tenants' block ids never meet
    out = []
    ci = ri = 0
    for take_chat in (rng.random(n) < 0.5).tolist():
        if take_chat:
            out.append(chat[ci])
            ci += 1
        else:
            r = rag[ri]
            ri += 1
            out.append(TraceRequest(r.input_length, tuple(x + offset for x in r.hash_ids)))
    return out


def longchat(n: int = 20_000, seed: int = 10) -> list[TraceRequest]:
    return _chats(n, seed, system_blocks=4, most_live=80, p_open=0.04, first=(2, 5), turns=(10, 41), extra_tokens=400)


TRACES: dict[str, Callable[..., list[TraceRequest]]] = {
    "documents": documents,
    "conversations": conversations,
    "agents": agents,
    "scans": scans,
    "coding": coding,
    "fewshot": fewshot,
    "drift": drift,
    "bursts": bursts,
    "mixed": mixed,
    "longchat": longchat,
}

HELD_OUT = ("drift", "bursts", "mixed", "longchat")
"""Traces kept out of tuning the default policy: its figures on them are reported apart."""
