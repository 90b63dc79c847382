"""What an operator sees of steering: `kdn model info` (calibration, measured effect) and an
origin's stats (how many documents hold a steered variant)."""

from __future__ import annotations

import json
import time

import torch

from kdn.keys import ChunkKey
from kdn.models import load_model
from kdn.ops.model import main as model_main
from kdn.origin.steer import STEER_SUFFIX, steering_details
from kdn.origin.store import DocumentRecord, OriginStore
from kdn.steer import steering_line
from kdn.steer.methods import KeyEditCalibration, calibration_summary, write_calibration


def _cal(fp: str) -> KeyEditCalibration:
    notes = {"rule": "^# NOTE:", "measured": {
        "haystacks": 200, "weak_depths": ["0", "0.25"],
        "by_depth": {"realistic": {"0": {"plain": 0.2, "steered": 0.3, "delta": 0.1, "p": 0.001},
                                   "0.25": {"plain": 0.4, "steered": 0.42, "delta": 0.02, "p": 0.5}}},
        "claims": {"realistic": {"met": True}, "random": {"met": True}}}}
    return KeyEditCalibration(fp, ((15, 0), (16, 1)), torch.ones(2, 8), 2.0, 4096, notes, "ramp")


def test_a_model_without_calibration_offers_re_read_only(tmp_path) -> None:
    s = calibration_summary("ab" * 32, tmp_path)
    assert s["methods"] == ["re-read"] and s["key_edit"] is None and "not calibrated" in s["problem"]
    (tmp_path / f"{'ab' * 32}.json").write_text("{broken")
    s = calibration_summary("ab" * 32, tmp_path)
    assert s["key_edit"] is None and "malformed" in s["problem"]


def test_a_calibrated_model_shows_its_profile_and_measured_effect(tmp_path) -> None:
    fp = "cd" * 32
    write_calibration(_cal(fp), tmp_path)
    s = calibration_summary(fp, tmp_path)
    ke = s["key_edit"]
    assert s["methods"] == ["key-edit", "re-read"]
    assert (ke["profile"], ke["strength"], ke["heads"], ke["layers"]) == ("ramp", 2.0, 2, "15-16")
    assert ke["measured"]["realistic"] == {"0": 10.0, "0.25": 2.0} and ke["measured"]["claims_met"]["realistic"]
    line = steering_line({"variants": 3, **s})
    assert line.startswith("3 document(s) with a steered variant") and "key-edit ramp 2 nats" in line
    assert "\n" not in line  # kdn stats keeps it on the origin's head line
    assert "0: +10.0" in line and "0.25: +2.0" in line


def test_origin_stats_count_documents_with_a_variant(tmp_path, monkeypatch) -> None:
    from kdn.steer import methods

    monkeypatch.setattr(methods, "calibration_root", lambda env=None: tmp_path / "cal")
    fp = bytes(range(32))
    store = OriginStore(tmp_path / "store")
    try:
        for tenant, doc in (("a", "x.md"), ("a", "x.md" + STEER_SUFFIX), ("b", "y.md" + STEER_SUFFIX), ("b", "y.md")):
            store.record_document(DocumentRecord(tenant, fp, doc, "h", 10, (ChunkKey(bytes(32)),), 0, time.time()))
        details = steering_details(store, [fp])
    finally:
        store.close()
    d = details[fp.hex()]
    assert d["variants"] == 2 and d["key_edit"] is None
    assert "x.md" not in json.dumps(details)  # counts only: no tenant's document names
    assert steering_line(d).startswith("2 document(s) with a steered variant; methods re-read")


def test_kdn_model_info_names_the_steering(tmp_path, capsys, monkeypatch) -> None:
    from kdn.steer import methods

    monkeypatch.setattr(methods, "calibration_root", lambda env=None: tmp_path)
    lm = load_model("tiny")
    write_calibration(_cal(bytes(lm.fingerprint).hex()), tmp_path)
    assert model_main(["info", "tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["steering"]["key_edit"]["profile"] == "ramp"


def test_a_shipped_calibration_answers_where_the_cache_has_none_and_the_users_own_wins(tmp_path, monkeypatch) -> None:
    from kdn.steer import methods

    monkeypatch.setattr(methods, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    fp = "ef" * 32
    assert methods.load_calibration(fp) is None
    shipped = _cal(fp)
    write_calibration(shipped, tmp_path / "shipped")
    assert methods.load_calibration(fp).digest == shipped.digest
    assert methods.load_calibration(fp, tmp_path / "cache" / "steer-calibrations") is None  # an explicit root: only it
    s = calibration_summary(fp)
    assert s["key_edit"]["source"] == "shipped with KDN" and s["key_edit"]["measured"]["claims_met"]["realistic"]
    own = KeyEditCalibration(fp, ((3, 0),), torch.ones(1, 8), 1.0, 4096, {}, "flat")
    write_calibration(own)  # a user's own kdn eval-steer
    assert methods.load_calibration(fp).digest == own.digest != shipped.digest
    assert calibration_summary(fp)["key_edit"]["source"].startswith("measured on this machine")
