"""``kdn eval-steer`` end to end on the tiny retrieval preset (the code paths, not the accuracy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdn.lab import steer_eval
from kdn.lab.reference import main as model_main
from kdn.models import load_model
from kdn.steer.methods import load_calibration


@pytest.fixture(scope="module")
def tiny_retrieval(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "retrieval"
    assert model_main(["train-reference", "--task", "retrieval", "--preset", "tiny", "--out", str(out), "--json"]) == 0
    return out


def test_cases_put_the_answer_where_asked(tiny_retrieval):
    lm = load_model(str(tiny_retrieval))
    for where, allowed in (("start", {0}), ("middle", {1}), ("end", {2})):
        for c in steer_eval.make_cases(tiny_retrieval, lm, 5, 3, where, seed=3):
            assert c.target in allowed and c.wrong != c.target
            s, e = c.span(c.target)
            doc = c.context[s:e]
            key = c.question[-1]
            assert key in doc and doc[doc.index(key) + 1 : doc.index(key) + 1 + len(c.answer)] == list(c.answer)
            assert key not in [t for i, d in enumerate(c.docs) if i != c.target for t in d]  # distractors lack it
    a = steer_eval.make_cases(tiny_retrieval, lm, 3, 3, "middle", seed=3)
    assert a == steer_eval.make_cases(tiny_retrieval, lm, 3, 3, "middle", seed=3)  # seeded
    cal = steer_eval.calibration_prompts(tiny_retrieval, lm, 3, 3, seed=3)
    assert not {p.context for p in cal} & {tuple(c.context) for c in a}  # calibration never sees held-out prompts


def test_eval_steer_reports_every_variant_by_position(tiny_retrieval, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    argv = ["--model", str(tiny_retrieval), "--docs", "3", "--prompts", "3", "--cal-prompts", "3", "--chunk-size", "16",
            "--json"]
    assert steer_eval.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["variants"]) == {"plain", "key-edit", "key-edit, wrong marks", "re-read", "re-read marked",
                                    "re-read marked, wrong marks"}
    for name, row in out["variants"].items():
        for where in steer_eval.POSITIONS:
            cell = row[where]
            assert cell["n"] == 3 and 0.0 <= cell["ci95"][0] <= cell["accuracy"] <= cell["ci95"][1] <= 1.0
            if name == "plain":
                assert cell["delta"] == 0.0
    plain_bytes = out["variants"]["plain"]["start"]["stored_bytes"]
    assert plain_bytes > 0
    for name, row in out["variants"].items():  # same KV payload; only the header's spec differs
        assert 0 <= row["start"]["stored_bytes"] - plain_bytes < 1024
    assert set(out["goal"]) == {"key-edit", "re-read", "re-read marked"}
    lm = load_model(str(tiny_retrieval), chunk_size=16)  # the fingerprint names the chunk size too
    cal = load_calibration(bytes(lm.fingerprint).hex())
    assert cal is not None and cal.digest == out["calibration"]["digest"]


def test_eval_steer_refuses_a_model_that_is_not_a_retrieval_model(tmp_path, capsys):
    assert steer_eval.main(["--model", "tiny", "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "InvalidInput" and "not a retrieval reference model" in err["message"]


def test_wilson_interval():
    lo, hi = steer_eval.wilson(50, 100)
    assert lo == pytest.approx(0.404, abs=1e-3) and hi == pytest.approx(0.596, abs=1e-3)
    assert steer_eval.wilson(0, 10)[0] == 0.0 and steer_eval.wilson(10, 10)[1] == 1.0
    m, lo, hi = steer_eval.paired([0, 0, 1, 1], [1, 1, 1, 1])
    assert m == 0.5 and lo < 0.5 < hi


def test_a_newer_trainers_task_fields_do_not_stop_the_eval(tiny_retrieval, tmp_path):
    meta = json.loads((tiny_retrieval / "kdn_reference.json").read_text())
    meta["train_config"]["task"]["future_curriculum_steps"] = 150  # a setting this build does not know
    (tmp_path / "kdn_reference.json").write_text(json.dumps(meta))
    task = steer_eval.prompt_task(tmp_path)
    assert task == steer_eval.prompt_task(tiny_retrieval) and not hasattr(task, "future_curriculum_steps")
