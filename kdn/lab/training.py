"""The training loop every lab trainer shares (:mod:`kdn.lab.reference`, :mod:`kdn.lab.retrieval`).

AdamW with no weight decay on 1-d parameters (norms, biases) and betas (0.9, 0.95), a learning
rate set per step, gradient clipping at 1.0 and next-token cross-entropy over ``(x, y)`` batches
(targets of -100 are ignored). What differs between trainers — the data, the schedule, what is
evaluated — comes in as arguments. Deterministic for a seeded model and a seeded ``batch``.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable

import torch

__all__ = ["fit"]


def fit(
    model: Any,
    *,
    steps: int,
    lr: float,
    weight_decay: float,
    lr_at: Callable[[int], float],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    desc: str,
    progress: bool = True,
) -> float:
    """Train ``model`` in place for ``steps`` steps; ``batch(step)`` gives ``(x, y)``, each (B, S).
    Returns the loss's moving average at the end (NaN after 0 steps)."""
    from tqdm import tqdm

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )
    bar = tqdm(range(steps), desc=desc, disable=not progress, file=sys.stderr, dynamic_ncols=True)
    ema = float("nan")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        x, y = batch(step)  # (B, S) each
        logits = model(input_ids=x).logits  # (B, S, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.item()
        ema = lv if math.isnan(ema) else 0.9 * ema + 0.1 * lv
        bar.set_postfix(loss=f"{ema:.3f}")
    bar.close()
    return ema
