"""``kdn.kv.layers_to_chunk``: one sequence's per-layer KV cut to a token range, as one chunk;
``kdn.kv.cache_from_layers``: a ``DynamicCache`` over given per-layer KV.

What must hold: the chunk is ``(L, 2, H, T, D)`` with layer l's K at ``[l, 0]`` and V at ``[l, 1]``,
bit for bit the source's tokens, contiguous and independent of the source; a cache's layers and
``(keys, values)`` pairs give the same chunk; without a range it is every token. A cache from
layers holds the given tensors without a copy, a forward over it never writes into them, and it
predicts what transformers' own cache of the same KV predicts.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kdn.kv import cache_from_layers, forward, layers_to_chunk


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


def test_a_cache_from_layers_holds_them_uncopied_and_a_forward_leaves_them_as_they_were(tiny_model) -> None:
    from transformers import DynamicCache

    model, cfg = tiny_model.model, tiny_model.config
    ids = torch.arange(3, 15).unsqueeze(0)  # (1, 12)
    with torch.inference_mode():
        out = forward(model, input_ids=ids[:, :8], use_cache=True)
        pairs = [(layer.keys.clone(), layer.values.clone()) for layer in out.past_key_values.layers]
        before = [(k.clone(), v.clone()) for k, v in pairs]
        cache = cache_from_layers(pairs, cfg)
        assert all(layer.keys.data_ptr() == k.data_ptr() and layer.values.data_ptr() == v.data_ptr()
                   for layer, (k, v) in zip(cache.layers, pairs))  # no copy
        assert cache.get_seq_length() == 8
        ours = forward(model, input_ids=ids[:, 8:], cache=cache, use_cache=True).logits
        theirs = forward(model, input_ids=ids[:, 8:], cache=DynamicCache([(k.clone(), v.clone()) for k, v in before],
                                                                          config=cfg), use_cache=True).logits
    assert torch.equal(ours, theirs)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(pairs, before))
    assert cache.get_seq_length() == 12  # it grew by appending, into tensors of its own
