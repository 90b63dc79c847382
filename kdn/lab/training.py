"""The model and the training loop every lab trainer shares (:mod:`kdn.lab.reference`, :mod:`kdn.lab.retrieval`).

:func:`new_llama` builds the fresh model of a trainer config's shape; :func:`fit` trains it.

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

__all__ = ["fit", "new_llama"]


def new_llama(shape: Any, vocab_size: int, eos_id: int, pad_id: int) -> Any:
    """A fresh Llama of a trainer config's ``shape`` (its ``hidden_size``, ``intermediate_size``,
    ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim`` and ``max_positions``): tied
    embeddings, RoPE base 10,000, ``eos_id`` also the BOS token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_positions,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, tie_word_embeddings=True, rope_theta=10000.0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


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
