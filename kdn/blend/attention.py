"""Attention for the selective pass: scattered queries, each seeing only the keys up to its position.

A blend recomputes a few hundred tokens spread over the whole context, each attending over the
mixed KV up to its own position (:func:`kdn.blend.recompute.blend`). Given that as one explicit
``(S, N)`` mask, an attention kernel computes every (query, key) pair and masks about half of
them away; transformers' SDPA path also copies the KV heads out to the query heads whenever a
mask is given (``repeat_kv``). Here the queries go in runs of ascending positions
(:class:`QueryGroup`), each over the keys up to its last position only, with the KV heads shared
by the kernel (``enable_gqa``): on a 4k-token context at 15% this does about half the work.

It runs as an attention implementation registered with transformers (``kdn_grouped_sdpa``) that
is plain SDPA for every call that does not carry ``kdn_groups``. :func:`grouped_attention` selects
it on a model whose implementation is ``sdpa`` for the length of a pass; calls that run meanwhile
on the same model from other threads (a prefill) go through the plain SDPA path unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch

GROUPED = "kdn_grouped_sdpa"


@dataclass(frozen=True, slots=True)
class QueryGroup:
    """Query rows ``rows`` of a pass, at positions ``q_pos`` ``(S_g,)``, attending over keys
    ``0..limit-1`` with the additive ``mask`` ``(1, 1, S_g, limit)``."""

    rows: slice
    q_pos: torch.Tensor
    limit: int
    mask: torch.Tensor


def causal_mask(q_pos: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``(1, 1, S, n)``: the query at absolute position p sees keys 0..p."""
    allowed = torch.arange(n).unsqueeze(0) <= q_pos.unsqueeze(1)  # (S, n)
    m = torch.zeros(allowed.shape, dtype=dtype)
    m.masked_fill_(~allowed, torch.finfo(dtype).min)
    return m.view(1, 1, *allowed.shape)


MIN_ROWS = 64  # fewest query rows in a group: smaller ones cost more in kernel calls than they save
MAX_GROUPS = 8  # past 8 runs the saving is within 1% of the most there is (~half of the pairs)


def query_groups(q_pos: torch.Tensor, dtype: torch.dtype) -> list[QueryGroup]:
    """``q_pos`` (sorted, distinct) in up to :data:`MAX_GROUPS` runs of equal row counts, each
    with the keys up to its last position and its mask. Keys past a run's last position are
    masked for every query in it, so they are left out, not computed and masked."""
    S = int(q_pos.numel())
    count = max(1, min(MAX_GROUPS, S // MIN_ROWS))
    bounds = [S * g // count for g in range(count + 1)]
    groups = []
    for a, b in zip(bounds, bounds[1:]):
        rows = q_pos[a:b]
        limit = int(rows[-1]) + 1
        groups.append(QueryGroup(slice(a, b), rows, limit, causal_mask(rows, limit, dtype)))
    return groups


def grouped_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 kdn_groups: list[QueryGroup] | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. ``query`` ``(1, Hq, S, D)``, ``key``/``value``
    ``(1, Hkv, N, D)``; returns ``(1, S, Hq, D)``. With ``kdn_groups`` (their rows covering
    ``0..S-1`` in order) the mask of the call is not used: each group's own is. Without, this is
    transformers' SDPA attention, argument for argument."""
    if kdn_groups is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    gqa = key.shape[1] != query.shape[1]
    outs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, g.rows], key[:, :, : g.limit], value[:, :, : g.limit], attn_mask=g.mask,
            dropout_p=dropout, scale=scaling, enable_gqa=gqa,
        )
        for g in kdn_groups
    ]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # (1, Hq, S, D)
    return out.transpose(1, 2).contiguous(), None


_swap_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register :data:`GROUPED` with transformers (once; it is imported here, not at import)."""
    global _registered
    with _swap_lock:
        if not _registered:
            from transformers import AttentionInterface

            AttentionInterface.register(GROUPED, grouped_sdpa)
            _registered = True


_swapped: dict[int, list[Any]] = {}  # id(config) -> [passes holding it, the implementation before]


@contextlib.contextmanager
def grouped_attention(model: Any) -> Iterator[bool]:
    """Select :func:`grouped_sdpa` on ``model`` for the block when its implementation is
    ``sdpa``; yields whether it did (pass ``kdn_groups`` to its layers only then). Passes that
    overlap on one model share the selection; the last one out restores the implementation."""
    register()
    cfg = model.config
    with _swap_lock:
        held = _swapped.get(id(cfg))
        if held is None and getattr(cfg, "_attn_implementation", None) == "sdpa":
            held = _swapped[id(cfg)] = [0, "sdpa"]
            cfg._attn_implementation = GROUPED
        if held is not None:
            held[0] += 1
    try:
        yield held is not None
    finally:
        if held is not None:
            with _swap_lock:
                held[0] -= 1
                if not held[0]:
                    cfg._attn_implementation = held[1]
                    del _swapped[id(cfg)]
