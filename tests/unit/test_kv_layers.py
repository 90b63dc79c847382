"""``kdn.kv.layers_to_chunk``: one sequence's per-layer KV cut to a token range, as one chunk.

What must hold: the chunk is ``(L, 2, H, T, D)`` with layer l's K at ``[l, 0]`` and V at ``[l, 1]``,
bit for bit the source's tokens, contiguous and independent of the source; a cache's layers and
``(keys, values)`` pairs give the same chunk; without a range it is every token.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kdn.kv import layers_to_chunk


def _layers(L: int = 3, H: int = 2, N: int = 10, D: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(1, H, N, D, generator=g), torch.randn(1, H, N, D, generator=g)) for _ in range(L)]


def test_a_token_range_of_pairs_and_of_cache_layers_is_the_same_chunk() -> None:
    pairs = _layers()
    cache_layers = [SimpleNamespace(keys=k, values=v) for k, v in pairs]
    chunk = layers_to_chunk(pairs, 3, 7)
    assert chunk.shape == (3, 2, 2, 4, 4) and chunk.is_contiguous()
    for l, (k, v) in enumerate(pairs):
        assert torch.equal(chunk[l, 0], k[0, :, 3:7]) and torch.equal(chunk[l, 1], v[0, :, 3:7])
    assert torch.equal(layers_to_chunk(cache_layers, 3, 7), chunk)
    pairs[0][0].zero_()
    assert chunk[0, 0].any()  # a copy: independent of the source


def test_without_a_range_the_chunk_holds_every_token() -> None:
    pairs = _layers(N=6)
    whole = layers_to_chunk(SimpleNamespace(keys=k, values=v) for k, v in pairs)
    assert whole.shape == (3, 2, 2, 6, 4)
    assert torch.equal(whole, torch.stack([torch.stack((k[0], v[0])) for k, v in pairs]))
