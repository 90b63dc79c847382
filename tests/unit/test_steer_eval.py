"""``kdn eval-steer`` on the trained model: the statistics, the claims, and the stages end to end
on a short haystack (the code paths and the bookkeeping; accuracy figures come from the benchmark)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kdn.lab import steer_eval
from kdn.lab.steer_eval import Setting
from kdn.steer.methods import load_calibration


def test_exact_mcnemar_and_wilson() -> None:
    base = [True] * 10 + [False] * 10
    assert steer_eval.mcnemar_exact(base, base) == (0, 0, 1.0)
    better = [True] * 10 + [True] * 8 + [False] * 2  # 8 gained, none lost: p = 2 / 2**8
    b, c, p = steer_eval.mcnemar_exact(base, better)
    assert (b, c) == (8, 0) and p == pytest.approx(2 / 256)
    b, c, p = steer_eval.mcnemar_exact(base, [False] + [True] * 9 + [True] + [False] * 9)  # 1 gained, 1 lost
    assert (b, c, p) == (1, 1, 1.0)
    lo, hi = steer_eval.wilson(50, 100)
    assert lo == pytest.approx(0.404, abs=1e-3) and hi == pytest.approx(0.596, abs=1e-3)
    assert steer_eval.wilson(0, 10)[0] == 0.0 and steer_eval.wilson(10, 10)[1] == 1.0


def _row(deltas: dict[str, float], p: float = 0.001) -> dict[str, dict[str, float]]:
    return {d: {"delta": v, "p": p, "accuracy": 0.5 + v} for d, v in deltas.items()}


def test_the_goal_needs_a_weak_depth_gain_and_no_loss_elsewhere() -> None:
    weak = ["0", "0.5"]
    ok = steer_eval.judge(_row({"0": 0.08, "0.5": 0.0, "1": -0.01}), weak)
    assert ok["met"] and ok["weak_depth"] == "0"
    assert not steer_eval.judge(_row({"0": 0.08, "0.5": 0.0, "1": -0.02}), weak)["met"]  # 2 points lost at the end
    assert not steer_eval.judge(_row({"0": 0.04, "0.5": 0.0, "1": 0.0}), weak)["met"]  # too small a gain
    assert not steer_eval.judge(_row({"0": 0.08, "0.5": 0.0, "1": 0.0}, p=0.2), weak)["met"]  # not significant
    assert not steer_eval.judge(_row({"0": 0.0, "0.5": 0.0, "1": 0.2}), weak)["met"]  # a gain where it was not weak
    assert steer_eval.weak_depths({"0": {"accuracy": 0.3}, "0.5": {"accuracy": 0.85}, "1": {"accuracy": 0.9}}) == ["0"]


def _cal(deltas: dict[str, float], logprob: dict[str, float], n: int = 40) -> dict[str, dict[str, float]]:
    return {d: {"delta": v, "p": 1.0, "n": n, "logprob_delta": logprob.get(d, 0.0)} for d, v in deltas.items()}


def test_the_calibration_chooses_the_strongest_setting_that_loses_nothing_it_can_see() -> None:
    """On a 40-haystack split one question is 2.5 points: accuracy counts a loss only beyond one
    question net; a fall of the answer's log-probability past the guard counts as a loss too."""
    weak = ["0", "0.25", "0.5", "0.75"]
    strong, mild, weakest = (Setting("key-edit", "all", "ramp", s) for s in (1.0, 0.5, 0.25))
    table = {  # the shape of the built-in model's calibration (seed 1)
        strong.name: _cal({"0": 0.1, "0.25": 0.35, "0.5": 0.125, "0.75": -0.025, "1": -0.075}, {"1": -0.22}),
        mild.name: _cal({"0": 0.025, "0.25": 0.2, "0.5": 0.1, "0.75": -0.025, "1": 0.0}, {"1": -0.09}),
        weakest.name: _cal({"0": 0.025, "0.25": 0.125, "0.5": 0.05, "0.75": -0.025, "1": 0.0}, {"1": -0.04}),
    }
    chosen, why = steer_eval.choose(table, weak, [strong, mild, weakest])
    assert chosen == mild and why["met_on_calibration"]
    # the same accuracies with a log-probability falling past the guard at the end: a loss
    table[mild.name]["1"]["logprob_delta"] = -steer_eval.LOGPROB_GUARD - 0.01
    assert steer_eval.choose(table, weak, [strong, mild, weakest])[0] == weakest
    # two questions lost net is a loss whatever the log-probability says
    table[weakest.name]["0.75"]["delta"] = -0.05
    chosen, why = steer_eval.choose(table, weak, [strong, mild, weakest])
    assert not why["met_on_calibration"] and chosen == strong  # nothing meets: the largest mean gain


@pytest.mark.timeout(900)  # about half a minute on a quiet 2-core machine
def test_stages_end_to_end_resume_and_write_the_calibration(tmp_path, monkeypatch) -> None:
    from kdn.steer import methods

    monkeypatch.setattr(methods, "calibration_root", lambda env=None: tmp_path / "calibrations")
    settings = (Setting("key-edit", "late", "ramp", 2.0), Setting("re-read"))
    plan = steer_eval.Plan(length=320, docs=3, test=1, calibration=1, means=1, deficit_lengths=(320,),
                           deficit_haystacks=1, chunk_size=64, settings=settings, kinds=steer_eval.MARK_KINDS)
    out = tmp_path / "run"
    res = steer_eval.run(plan, out)
    assert res["deficit"]["320"]["haystacks"] == 1 and set(res["deficit"]["320"]["depths"]) == {"0", "0.25", "0.5", "0.75", "1"}
    cal = res["calibration"]
    assert set(cal["table"]) == {"plain", "key-edit late ramp 2", "re-read"}
    assert cal["chosen"]["name"] in cal["table"]
    test = res["test"]
    assert set(test["table"]) == {"plain", "realistic", "headings", "oracle", "wrong", "random", "everything", "ceiling"}
    for name, row in test["table"].items():
        for depth, c in row.items():
            assert c["n"] == 1 and 0.0 <= c["ci95"][0] <= c["accuracy"] <= c["ci95"][1] <= 1.0
            if name != "plain":
                assert c["gained"] + c["lost"] <= 1 and 0.0 <= c["p"] <= 1.0
    lines = {p.name: p.read_text().count("\n") for p in out.glob("*.jsonl")}
    assert lines == {"deficit-320.jsonl": 1, "calibration.jsonl": 1, "test.jsonl": 1}
    again = steer_eval.run(plan, out)  # resumes: nothing is computed twice
    assert {p.name: p.read_text().count("\n") for p in out.glob("*.jsonl")} == lines
    same = lambda a, b: json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # noqa: E731
    assert same(again["test"]["table"], test["table"])
    if cal["chosen"]["method"] == "key-edit":
        from kdn.models import load_model

        lm = load_model("smollm2-135m", chunk_size=64)
        held = load_calibration(bytes(lm.fingerprint).hex())
        assert held is not None and held.profile == "ramp" and held.digest == cal["digest"]
        assert held.notes["measured"]["haystacks"] == 1 and "realistic" in held.notes["measured"]["by_depth"]
    summary = steer_eval.run(dataclasses.replace(plan, stages=("summary",)), out)  # tabulates, computes nothing
    assert same(summary["test"]["table"], again["test"]["table"])


def test_a_random_init_model_is_refused(tmp_path, capsys) -> None:
    assert steer_eval.main(["--model", "tiny", "--out", str(tmp_path), "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "InvalidInput" and "random-init" in err["message"]


def test_the_origin_stores_what_the_evaluation_measured() -> None:
    """`kdn ingest --emphasize key-edit --emphasize-regex '^# NOTE:'` resolves the same marks and
    computes the same KV as the evaluation's realistic variant of the same haystack."""
    import torch

    from kdn.lab.steer_task import NOTE_RULE, SourcePool, make_haystack
    from kdn.models import load_model
    from kdn.origin.steer import resolve
    from kdn.steer import Emphasis
    from kdn.steer.methods import full_kv, steered_kv

    lm = load_model("smollm2-135m", chunk_size=64)
    hs = make_haystack(SourcePool(lm.tokenizer, "test"), length=320, n_docs=3, seed=0, index=0)
    means = torch.randn(lm.kv_shape.num_layers, lm.kv_shape.num_kv_heads, lm.kv_shape.head_dim,
                        generator=torch.Generator().manual_seed(0))
    setting = Setting("key-edit", "late", "ramp", 2.0)
    steerer = steer_eval.Steerer(lm, means, 4096)
    cal = steerer.calibration(setting)
    base = full_kv(lm.model, hs.tokens)
    marks = steer_eval.marks_for(lm, hs, "realistic", hs.questions[0])
    measured = steerer.kv(setting, base, hs.tokens, marks)
    hit = steer_eval.stored_tokens(lm, hs.tokens)
    spec = resolve(Emphasis("key-edit", regex=NOTE_RULE), lm, hs.text, hit, cal, layout="system")
    assert spec.strength == 2.0 and spec.calibration == cal.digest
    assert list(spec.marks) == [(s, min(e, hit)) for s, e in marks if s < hit]
    stored = steered_kv(lm.model, list(hs.tokens[:hit]), spec, cal)
    assert stored.shape == measured.shape and torch.allclose(stored, measured, atol=1e-4)
    assert not torch.allclose(stored, base[:, :, :, :hit], atol=1e-4)  # the notes' keys were edited


@pytest.mark.parametrize("flags, message", [
    (["--threads", "0"], "--threads must be >= 1"), (["--strengths", "abc"], "--strengths must be a comma list"),
    (["--strengths=-1"], "--strengths must be positive"), (["--deficit-lengths", "abc"], "--deficit-lengths must be"),
    (["--deficit-lengths=-10"], "--deficit-lengths must be >= 1"), (["--length", "-5"], "--length"),
    (["--docs", "0"], "--docs must be in 2.."), (["--docs", "1", "--stages", "summary"], "--docs must be in 2.."),
    (["--docs", "5", "--length", "200"], "too short for --docs 5"),
])
def test_bad_flags_are_one_line_errors_before_the_model_loads(monkeypatch, tmp_path, capsys, flags, message) -> None:
    monkeypatch.setattr(steer_eval, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert steer_eval.main(["--out", str(tmp_path / "o"), *flags, "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "InvalidInput" and message in err["message"]
    assert not (tmp_path / "o").exists()


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "x"):
        assert steer_eval.main(["--out", str(out), "--stages", "summary", "--json"]) == 2
        err = json.loads(capsys.readouterr().out)
        assert err["error"] in ("InvalidInput", "NotADirectoryError") and str(tmp_path / "file") in err["message"]
    assert (tmp_path / "file").read_text() == "x"
