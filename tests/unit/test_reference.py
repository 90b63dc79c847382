"""The reference model's training path, run at the ``tiny`` preset (same code, seconds not minutes)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kdn.errors import InvalidInput
from kdn.lab.reference import (
    META_FILE,
    TrainConfig,
    cache_root,
    corpus_split,
    default_reference_dir,
    main,
    train_reference,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ref") / "model"
    assert main(["train-reference", "--preset", "tiny", "--out", str(out), "--json"]) == 0
    return out, json.loads((out / META_FILE).read_text())


def test_corpus_split_is_by_file_and_deterministic() -> None:
    a, b = corpus_split(), corpus_split()
    assert a == b
    assert not set(a.train) & set(a.heldout)
    assert 0.02 < len(a.heldout) / (len(a.train) + len(a.heldout)) < 0.1
    assert all("site-packages" not in p.parts and p.suffix == ".py" for p in a.train + a.heldout)
    small = corpus_split(max_files=8)
    assert small.train == a.train[:8] and small.heldout == a.heldout[:2]


def test_trained_dir_is_a_standard_hf_model(trained, capsys: pytest.CaptureFixture[str]) -> None:
    out, meta = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", META_FILE):
        assert (out / name).is_file()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = "def f(x):\n    return x + 1\n"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    from kdn.models import load_model

    lm = load_model(str(out))
    cfg = lm.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # grouped-query attention
    from kdn.ops.model import main as model_main

    assert model_main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fingerprint"] == bytes(lm.fingerprint).hex() and info["kv_heads"] == 1


def test_training_learns(trained) -> None:
    _, meta = trained
    r = meta["result"]
    assert r["heldout_loss"] < r["initial_heldout_loss"] - 0.5
    assert r["heldout_loss"] < r["uniform_loss"] - 0.5
    assert meta["corpus"]["heldout_files"] and meta["train_config"]["steps"] == 30


def test_training_is_reproducible(trained, tmp_path: Path) -> None:
    out, meta = trained
    again = train_reference(TrainConfig.preset("tiny"), tmp_path / "again", progress=False, log=lambda s: None)
    assert again.heldout_loss == meta["result"]["heldout_loss"]
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (out / "tokenizer.json").read_text() == (tmp_path / "again" / "tokenizer.json").read_text()


def test_existing_model_not_overwritten_without_force(trained, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = trained
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(["train-reference", "--preset", "tiny", "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] is True
    assert (out / "model.safetensors").stat().st_mtime_ns == before


def test_cache_dir_outside_repo_and_overridable(tmp_path: Path) -> None:
    assert cache_root({"KDN_CACHE": str(tmp_path)}) == tmp_path
    assert default_reference_dir({"KDN_CACHE": str(tmp_path)}) == tmp_path / "reference-model"
    assert cache_root({}) == Path.home() / ".cache" / "kdn"


def test_bad_config_is_a_clear_error() -> None:
    with pytest.raises(InvalidInput):
        replace(TrainConfig.preset("tiny"), num_kv_heads=3)
    with pytest.raises(InvalidInput):
        TrainConfig.preset("huge")
