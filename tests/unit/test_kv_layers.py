"""``kdn.kv.layers_to_chunk``: one sequence's per-layer KV cut to a token range, as one chunk;
``kdn.kv.cache_from_layers``: a ``DynamicCache`` over given per-layer KV.

What must hold: the chunk is ``(L, 2, H, T, D)`` with layer l's K at ``[l, 0]`` and V at ``[l, 1]``,
bit for bit the source's tokens, contiguous and independent of the source; a cache's layers and
``(keys, values)`` pairs give the same chunk; without a range it is every token. A cache from
layers holds the given tensors without a copy, a forward over it never writes into them, and it
predicts what transformers' own cache of the same KV predicts. A cache in a room decodes into the
room in place, as transformers' cache would decode, never writes below what a layer held, and
appends by concatenation once the room is full.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kdn.kv import cache_from_layers, cache_in_room, forward, layers_to_chunk


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


def _greedy(model, cache, first: int, steps: int) -> list[torch.Tensor]:
    """Logits of ``steps`` greedy steps from token ``first`` over ``cache``."""
    out, nxt = [], first
    for _ in range(steps):
        logits = forward(model, input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True).logits[0, -1]
        out.append(logits)
        nxt = int(torch.argmax(logits))
    return out


def test_a_cache_in_a_room_decodes_into_it_as_transformers_cache_would_and_spills_over_when_full(tiny_model) -> None:
    from transformers import DynamicCache

    model, cfg = tiny_model.model, tiny_model.config
    ids = torch.arange(3, 13).unsqueeze(0)  # (1, 10)
    with torch.inference_mode():
        layers = forward(model, input_ids=ids, use_cache=True).past_key_values.layers
        pairs = [(layer.keys.clone(), layer.values.clone()) for layer in layers]
        theirs = _greedy(model, DynamicCache([(k.clone(), v.clone()) for k, v in pairs], config=cfg), 5, 6)
        rooms = [(torch.cat([k, torch.full_like(k[:, :, :3], 7.0)], dim=2),
                  torch.cat([v, torch.full_like(v[:, :, :3], 7.0)], dim=2)) for k, v in pairs]  # room for 3 more
        cache = cache_in_room(rooms, 10, cfg)
        held = [(layer.keys, layer.values) for layer in cache.layers]  # what a write-back would read
        held_before = [(k.clone(), v.clone()) for k, v in held]
        ours = _greedy(model, cache, 5, 6)  # 3 steps fit, then 3 more spill over
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(ours, theirs))
    assert cache.get_seq_length() == 16
    for (rk, rv), layer in zip(rooms, cache.layers):
        assert not (rk[:, :, 10:] == 7.0).all() and not (rv[:, :, 10:] == 7.0).all()  # decoded into the room
        assert torch.equal(layer.keys[:, :, :13], rk) and torch.equal(layer.values[:, :, :13], rv)
        assert layer.keys.data_ptr() != rk.data_ptr()  # full: concatenated into a tensor of its own
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(held, held_before))


def test_a_cropped_room_cache_never_writes_below_what_it_held(tiny_model) -> None:
    model, cfg = tiny_model.model, tiny_model.config
    with torch.inference_mode():
        layers = forward(model, input_ids=torch.arange(3, 11).unsqueeze(0), use_cache=True).past_key_values.layers
        rooms = [(torch.cat([l.keys, torch.zeros_like(l.keys)], dim=2), torch.cat([l.values, torch.zeros_like(l.values)], dim=2))
                 for l in layers]
        before = [(k.clone(), v.clone()) for k, v in rooms]
        cache = cache_in_room(rooms, 8, cfg)
        for layer in cache.layers:  # what a crop to 6 tokens does (its argument differs across transformers)
            layer.keys, layer.values = layer.keys[:, :, :6], layer.values[:, :, :6]
        _greedy(model, cache, 5, 2)
    assert cache.get_seq_length() == 8
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(rooms, before))
