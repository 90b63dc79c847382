"""The quality harness: exact vs codec KV through the real container, judged by the model's outputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kdn.errors import InvalidInput, UnknownCodec
from kdn.lab.quality import EvalSetup, evaluate, format_table, make_windows, random_init_twin

TEXT = [
    "def add(a, b):\n    return a + b\n\n" * 30,
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n" * 20,
]


def _setup(**kw) -> EvalSetup:
    return EvalSetup(**{"windows": 2, "continuation": 10, "timing_repeats": 1, **kw})


@pytest.fixture(scope="module")
def tiny32():
    from kdn.models import load_model

    return load_model("tiny", chunk_size=32)


def test_lossless_codecs_change_nothing(tiny32) -> None:
    report = evaluate(tiny32, ["raw", "zstd"], _setup(kv_dtype="float32"), TEXT)
    for r in report.results:
        assert r.top1_agreement == 1.0 and r.mean_kl == 0.0 and r.ppl_change == 0.0  # bit-exact KV
        assert r.predictions == 2 * 10
    raw, zstd = report.results
    assert 0.45 < raw.size_ratio < 0.5  # stored as fp32: twice the fp16 bytes, plus framing
    assert raw.fp16_bytes == zstd.fp16_bytes == 2 * 2 * 2 * 2 * 32 * 32 * 2  # windows·L·2·H·T·D·2 bytes


def test_lossy_codecs_measured_not_assumed(tiny32) -> None:
    report = evaluate(tiny32, ["raw", "int8", "kvq:q8", "kvq:q2"], _setup(), TEXT)
    raw, int8, q8, q2 = report.results
    assert raw.mean_kl < 1e-6 and 0.95 < raw.size_ratio <= 1.0  # fp16 storage: rounding only
    assert q2.mean_kl > q8.mean_kl > 0.0  # fewer bits, further from the exact distribution
    assert q2.size_ratio > q8.size_ratio > int8.size_ratio * 0.9 > 1.5
    assert q2.lossy and not raw.lossy and q2.codec == "kvq:q2"
    assert all(r.decode_gbps > 0 and r.encode_gbps > 0 for r in report.results)
    assert math.isfinite(q2.crossover_gbps) and q2.crossover_gbps > 0
    assert "kvq:q2" in format_table(report.results)


def test_quality_tracks_the_kv_not_the_codec_name(tiny32, monkeypatch: pytest.MonkeyPatch) -> None:
    """Garbage KV must show up as disagreement: the harness really conditions on decoded KV."""
    from kdn.codecs import kvq

    real = kvq.KvqCodec.decode
    monkeypatch.setattr(kvq.KvqCodec, "decode", lambda self, p, info: real(self, p, info) * 0 + 3.0)
    r = evaluate(tiny32, ["kvq:q8"], _setup(), TEXT).results[0]
    assert r.mean_kl > 1e-3


def test_windows_bounded_by_model_positions(tiny32) -> None:
    with pytest.raises(InvalidInput, match="positions"):
        make_windows(tiny32, TEXT, EvalSetup(windows=1, context_chunks=300, continuation=8))
    with pytest.raises(InvalidInput, match="tokens"):
        make_windows(tiny32, ["short"], _setup())
    with pytest.raises(UnknownCodec):
        evaluate(tiny32, ["nope"], _setup(), TEXT)


def test_random_init_twin_has_its_own_fingerprint(tiny32) -> None:
    twin = random_init_twin(tiny32, seed=7)
    assert twin.fingerprint != tiny32.fingerprint
    assert twin.kv_shape == tiny32.kv_shape
    a = next(twin.model.parameters())
    assert not torch.equal(a, next(tiny32.model.parameters()))


def test_cli_json(tmp_path, capsys) -> None:
    from kdn.lab.quality import main

    text = tmp_path / "t.txt"
    text.write_text(TEXT[0] + TEXT[1])
    rc = main(["--model", "tiny", "--chunk-size", "32", "--windows", "2", "--continuation", "8",
               "--text", str(text), "--codec", "raw,kvq:q4", "--codec", "int8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["codec"] for r in out["results"]] == ["raw", "kvq:q4", "int8"]
    assert main(["--model", "tiny", "--codec", "kvq:q9"]) == 2
    assert "unknown kvq level" in capsys.readouterr().err


def test_calibration_spends_bits_where_the_model_is_sensitive(tiny32) -> None:
    from kdn.lab.quality import calibrate_kvq, exact_runs

    runs = exact_runs(tiny32, make_windows(tiny32, TEXT, _setup()))
    cal = calibrate_kvq(tiny32, runs, "q3", _setup())
    assert cal.probe_bits == 2 and len(cal.kl) == 2 and all(k > 0 and v > 0 for k, v in cal.kl)
    flat = sorted(((cal.kl[l][s], l, s) for l in range(2) for s in (0, 1)), reverse=True)
    _, layer, slot = flat[0]
    from kdn.codecs.kvq import LEVELS

    assert cal.plan.table[layer][slot] == LEVELS["q3"][slot] + 2  # the most sensitive slot got the bonus
    assert sum(b for row in cal.plan.table for b in row) == 2 * sum(LEVELS["q3"]) + 2 * 2  # the rule's budget
    with pytest.raises(InvalidInput):
        calibrate_kvq(tiny32, runs, "q9", _setup())
