"""Chunk keys: deterministic across processes, chained, and sensitive to everything they cover."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kdn.errors import InvalidInput
from kdn.keys import (
    KEY_BYTES,
    ROOT_KEY,
    ModelFingerprint,
    Namespace,
    chunk_keys,
    next_key,
    parse_fingerprint,
    parse_key,
)

FP_A = ModelFingerprint(bytes(range(32)))
FP_B = ModelFingerprint(bytes(range(1, 33)))
NS = Namespace("tenant-a", "salt")
CHUNK = 16


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


def _first_diff(a: list[bytes], b: list[bytes]) -> int | None:
    """Index of the first differing key; asserts that every key from there on differs too."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is not None:
        assert all(x != y for x, y in zip(a[first:], b[first:])), "a chain re-converged after a difference"
    return first


_CHILD = """
import json, sys
from kdn.keys import chunk_keys, Namespace, ModelFingerprint
toks = json.loads(sys.stdin.read())
keys = chunk_keys(toks, fingerprint=ModelFingerprint(bytes(range(32))), namespace=Namespace("tenant-a", "salt"),
                  chunk_size=16)
print(json.dumps([k.hex() for k in keys] + [str(hash("probe"))]))
"""


def test_keys_equal_across_processes_with_different_hash_seeds() -> None:
    toks = _tokens(100)
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD], input=json.dumps(toks), capture_output=True, text=True, env=env,
            timeout=60, check=True,
        )
        outputs.append(json.loads(proc.stdout))
    (*keys1, probe1), (*keys2, probe2) = outputs
    assert probe1 != probe2, "the two children did not really run with different hash seeds"
    assert keys1 == keys2
    local = [k.hex() for k in chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)]
    assert local == keys1
    assert len(local) == 100 // CHUNK


def test_only_full_chunks_get_keys() -> None:
    assert chunk_keys(_tokens(15), fingerprint=FP_A, namespace=NS, chunk_size=CHUNK) == []
    assert len(chunk_keys(_tokens(16), fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)) == 1
    assert len(chunk_keys(_tokens(47), fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)) == 2
    assert chunk_keys([], fingerprint=FP_A, namespace=NS, chunk_size=CHUNK) == []


def test_keys_are_chained_from_the_root() -> None:
    toks = _tokens(64)
    keys = chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)
    parent = ROOT_KEY
    for i, key in enumerate(keys):
        assert len(key) == KEY_BYTES
        assert key == next_key(parent, FP_A, NS, toks[i * CHUNK : (i + 1) * CHUNK])
        parent = key
    assert len(set(keys)) == len(keys)


def test_a_prefix_has_the_same_keys_as_the_start_of_a_longer_text() -> None:
    toks = _tokens(160)
    long = chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)
    short = chunk_keys(toks[:70], fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)
    assert long[: len(short)] == short


@pytest.mark.parametrize("position", [0, 5, 31, 32, 70, 127])
def test_changing_one_token_changes_every_key_from_its_chunk_on(position: int) -> None:
    toks = _tokens(128)
    base = chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)
    changed = list(toks)
    changed[position] += 1
    other = chunk_keys(changed, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)
    assert _first_diff(base, other) == position // CHUNK


def test_changing_model_or_namespace_changes_every_key() -> None:
    toks = _tokens(128)
    base = chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)
    variants = [
        chunk_keys(toks, fingerprint=FP_B, namespace=NS, chunk_size=CHUNK),
        chunk_keys(toks, fingerprint=FP_A, namespace=Namespace("tenant-b", "salt"), chunk_size=CHUNK),
        chunk_keys(toks, fingerprint=FP_A, namespace=Namespace("tenant-a", "other"), chunk_size=CHUNK),
        chunk_keys(toks, fingerprint=FP_A, namespace=Namespace("tenant-a"), chunk_size=CHUNK),
    ]
    for keys in variants:
        assert _first_diff(base, keys) == 0


def test_namespace_encoding_is_unambiguous() -> None:
    toks = _tokens(32)
    a = chunk_keys(toks, fingerprint=FP_A, namespace=Namespace("ab", "c"), chunk_size=CHUNK)
    b = chunk_keys(toks, fingerprint=FP_A, namespace=Namespace("a", "bc"), chunk_size=CHUNK)
    assert _first_diff(a, b) == 0


def test_changing_chunk_size_changes_every_key() -> None:
    """Two chunk sizes never share a key, and the model fingerprint covers the chunk size too."""
    toks = _tokens(128)
    k16 = set(chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=16))
    k32 = set(chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=32))
    assert not k16 & k32


def test_fingerprint_covers_chunk_size_dtype_and_weights(tiny_model) -> None:
    from kdn.models import model_fingerprint

    cfg = tiny_model.config
    base = model_fingerprint(cfg, weights_id="w", dtype="float32", chunk_size=256)
    assert base == model_fingerprint(cfg, weights_id="w", dtype="float32", chunk_size=256)
    others = {
        model_fingerprint(cfg, weights_id="w", dtype="float32", chunk_size=128),
        model_fingerprint(cfg, weights_id="w", dtype="bfloat16", chunk_size=256),
        model_fingerprint(cfg, weights_id="w2", dtype="float32", chunk_size=256),
    }
    assert base not in others and len(others) == 3


def test_builtin_fingerprints_differ_between_models_and_agree_across_loads(tiny_model, tiny_mha_model) -> None:
    from kdn.models import load_model

    assert tiny_model.fingerprint != tiny_mha_model.fingerprint
    assert load_model("tiny").fingerprint == tiny_model.fingerprint
    assert load_model("tiny", chunk_size=128).fingerprint != tiny_model.fingerprint


def test_tokens_as_numpy_or_list_give_the_same_keys() -> None:
    toks = _tokens(64)
    as_list = chunk_keys(toks, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)
    for dtype in (np.int64, np.int32, np.uint32):
        assert chunk_keys(np.asarray(toks, dtype=dtype), fingerprint=FP_A, namespace=NS, chunk_size=CHUNK) == as_list


@pytest.mark.parametrize(
    "tokens", [[-1] * 16, [2**32] * 16, [[1, 2]] * 8, np.zeros(16, dtype=np.float32)], ids=["neg", "big", "2d", "float"]
)
def test_bad_tokens_are_refused(tokens: object) -> None:
    with pytest.raises(InvalidInput):
        chunk_keys(tokens, fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)  # type: ignore[arg-type]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidInput):
        chunk_keys(_tokens(16), fingerprint=FP_A, namespace=NS, chunk_size=0)
    with pytest.raises(InvalidInput):
        chunk_keys(_tokens(16), fingerprint=ModelFingerprint(b"short"), namespace=NS, chunk_size=CHUNK)
    for tenant in ("", "a/b", "x" * 129, "ten ant"):
        with pytest.raises(InvalidInput):
            Namespace(tenant)
    with pytest.raises(InvalidInput):
        Namespace("t", "s" * 257)


def test_parse_key_round_trips_and_refuses_garbage() -> None:
    key = chunk_keys(_tokens(16), fingerprint=FP_A, namespace=NS, chunk_size=CHUNK)[0]
    assert parse_key(key.hex()) == key
    assert parse_key(bytes(key)) == key
    assert parse_fingerprint(bytes(FP_A).hex()) == FP_A
    for bad in ("zz" * 32, "ab" * 31, b"\x00" * 31, ""):
        with pytest.raises(InvalidInput):
            parse_key(bad)
    with pytest.raises(InvalidInput, match="fingerprint"):
        parse_fingerprint("ab")


def test_namespace_parse() -> None:
    assert Namespace.parse("acme:pepper") == Namespace("acme", "pepper")
    assert Namespace.parse("acme") == Namespace("acme", "")
    assert str(Namespace("acme", "s")) == "acme"
