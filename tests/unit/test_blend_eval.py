"""The retrieval reference model's trainer (tiny preset) and ``kdn eval-blend`` end to end, fast.

Quality numbers come from ``benchmarks/blend.py`` on the default preset; here the code paths run:
atomic, seeded output that loads as a model directory; held-out prompts of the recorded task;
every method scored against full prefill; a verdict written for the model's fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kdn.blend.verdict import read_verdict
from kdn.lab import blend_eval
from kdn.lab.reference import main as model_main
from kdn.lab.retrieval import RetrievalTrainConfig, heldout_prompts, load_task, make_prompt
from kdn.models import load_model


@pytest.fixture(scope="module")
def tiny_retrieval(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "retrieval"
    assert model_main(["train-reference", "--task", "retrieval", "--preset", "tiny", "--out", str(out), "--json"]) == 0
    return out


def test_task_prompts_have_unique_keys_and_the_answer_in_one_document() -> None:
    task = RetrievalTrainConfig().task
    prompt, qs = make_prompt(task, 8, torch.Generator().manual_seed(0), n_questions=5)
    assert len(prompt.docs) == 8 and all(len(d) == task.doc_tokens for d in prompt.docs)
    keys = [w for d in prompt.docs for w in d if w.startswith("k")]
    assert len(keys) == len(set(keys)) == 8 * task.facts_per_doc
    doc = prompt.docs[prompt.answer_doc]
    i = doc.index(prompt.question[1])
    assert tuple(doc[i + 1 : i + 3]) == prompt.answer
    assert heldout_prompts(task, 3, 8, 0) == heldout_prompts(task, 3, 8, 0)  # seeded
    assert heldout_prompts(task, 3, 8, 0) != [make_prompt(task, 8, torch.Generator().manual_seed(1))[0] for _ in range(3)]


def test_training_phases_induction_long_range_induction_then_the_task() -> None:
    """Each phase's batches: a copy of a word sequence (short, then long range) supervised on the copy
    only; then task sequences supervised on the answer words only; the lr of each phase."""
    from dataclasses import replace

    from kdn.lab.retrieval import _lr_at, _train_batch, build_tokenizer

    cfg = RetrievalTrainConfig.preset("default")
    task = cfg.task
    assert task.warm_steps < task.warm_steps + task.long_steps < cfg.steps
    tok = build_tokenizer(task)
    gen = torch.Generator().manual_seed(0)
    W = task.warm_len
    longest = 0
    for step in (0, task.warm_steps, task.warm_steps + 1, task.warm_steps + 2, task.warm_steps + 3):
        x, y = _train_batch(cfg, tok, gen, step)
        rows = torch.cat((x, y[:, -1:]), 1)  # y is x shifted by one; its last word is supervised
        sup = y != -100
        assert (sup.sum(1) == W - 1).all() and sup[:, -(W - 1):].all()  # the copy after its first word, nothing else
        assert torch.equal(y[:, -(W - 1):], rows[:, -(W - 1):])
        n = rows.shape[1]
        assert all(any(torch.equal(row[i : i + W], row[-W:]) for i in range(n - 2 * W + 1))
                   for row in rows)  # the copied sequence occurs earlier in its row
        if step >= task.warm_steps:
            assert rows.numel() <= task.long_tokens and n - 2 * W in task.long_gaps
        longest = max(longest, n)
    assert longest > 2 * task.warm_len * 3  # the long phase reaches past the warm-up's distances
    x, y = _train_batch(cfg, tok, gen, task.warm_steps + task.long_steps)
    answers = y[y != -100]
    vals = {tok.token_to_id(f"v{i}") for i in range(task.num_values)}
    assert answers.numel() > 0 and set(answers.tolist()) <= vals
    n_docs = (x[0] == tok.token_to_id("D")).sum().item()
    assert task.short_docs < n_docs <= task.max_docs  # short_share 0: no 1-document sequences
    # schedule: the warm-up as before (cosine over lr_horizon), then constant long_lr, task_lr, a final decay
    old = replace(cfg, task_lr=0.0, steps=cfg.lr_horizon, lr_horizon=0)
    assert all(_lr_at(s, cfg) == _lr_at(s, old) for s in range(task.warm_steps))
    assert _lr_at(task.warm_steps, cfg) == _lr_at(task.warm_steps + task.long_steps - 1, cfg) == cfg.long_lr
    assert _lr_at(task.warm_steps + task.long_steps, cfg) == cfg.task_lr
    assert _lr_at(cfg.steps - 1, cfg) < 0.1 * cfg.task_lr


def test_one_word_answers_lay_out_and_score_like_two_word_ones() -> None:
    from dataclasses import replace
    from types import SimpleNamespace

    from kdn.lab.retrieval import build_tokenizer, full_prefill_accuracy, prompt_ids

    cfg = RetrievalTrainConfig.preset("tiny")
    for words in (1, 2):
        task = replace(cfg.task, value_words=words)
        prompt, _ = make_prompt(task, 3, torch.Generator().manual_seed(0))
        doc = prompt.docs[prompt.answer_doc]
        i = doc.index(prompt.question[1])
        assert len(prompt.answer) == words and tuple(doc[i + 1 : i + 2 + words]) == (*prompt.answer, ".")
        assert all(len(d) == task.doc_tokens for d in prompt.docs)
        tok = build_tokenizer(task)
        pre, docs, q, ans = prompt_ids(tok, prompt)
        seen = []

        class Says:  # predicts ``ids`` at the last positions; records what it was fed
            def __init__(self, ids: list[int]) -> None:
                self.ids = ids

            def eval(self) -> None: ...

            def train(self) -> None: ...

            def __call__(self, input_ids, logits_to_keep):
                seen.append((input_ids[0].tolist(), logits_to_keep))
                logits = torch.zeros(1, logits_to_keep, tok.get_vocab_size())
                logits[0, torch.arange(logits_to_keep), torch.tensor(self.ids[-logits_to_keep:])] = 1.0
                return SimpleNamespace(logits=logits)

        assert full_prefill_accuracy(Says(ans), tok, [prompt]) == 1.0
        assert seen[-1] == (pre + sum(docs, []) + q + ans[:-1], words)  # teacher-forced on earlier answer words only
        wrong = [(a + 1) % tok.get_vocab_size() for a in ans]
        assert full_prefill_accuracy(Says(ans[:-1] + wrong[-1:]), tok, [prompt]) == 0.0


def test_trained_output_is_a_loadable_model_dir_with_its_task(tiny_retrieval: Path) -> None:
    assert not list(tiny_retrieval.parent.glob(".retrieval.tmp-*"))  # renamed into place, nothing left over
    cfg, meta = load_task(tiny_retrieval)
    assert meta["task"] == "retrieval" and cfg.task.doc_tokens == 32
    lm = load_model(str(tiny_retrieval))
    assert lm.tokenizer.encode("D : k3 v1 .") == [lm.tokenizer.encode(w)[0] for w in "D : k3 v1 .".split()]


def test_retraining_over_a_model_needs_force(tiny_retrieval: Path, capsys) -> None:
    before = (tiny_retrieval / "kdn_reference.json").read_text()
    capsys.readouterr()
    assert model_main(["train-reference", "--task", "retrieval", "--preset", "tiny", "--out", str(tiny_retrieval), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"out_dir": str(tiny_retrieval), "skipped": True}
    assert "--force" in captured.err and (tiny_retrieval / "kdn_reference.json").read_text() == before


def test_eval_blend_scores_every_method_and_writes_a_verdict(tiny_retrieval: Path, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    assert blend_eval.main(["--model", str(tiny_retrieval), "--prompts", "4", "--docs", "3", "--check-prompts", "2",
                            "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "retrieval" and out["prompts"] == out["prompts_done"] == 4
    names = set(out["methods"])
    assert {"full", "prefix-only", "naive", "first-16", "naive+lead", "blend@0.05", "blend@0.15", "blend@0.3",
            "blend@0.5", "blend@0.7", "random@0.15", "blend@1"} == names  # the verdict's whole ladder
    full = out["methods"]["full"]
    assert full["agreement"] == 1.0 and full["kl"] == 0.0 and full["prompts"] == 4
    assert out["methods"]["prefix-only"]["agreement"] == 1.0  # exact reuse is exact
    check = out["methods"]["blend@1"]
    assert check["prompts"] == 2 and check["max_logit_diff"] < 1e-3 and check["agreement"] == 1.0
    assert 0.14 <= out["methods"]["blend@0.15"]["recomputed"] <= 0.2
    assert out["methods"]["random@0.15"]["recomputed"] == out["methods"]["blend@0.15"]["recomputed"]
    assert out["methods"]["naive"]["vs_full"]["prompts"] == 4  # paired on the same prompts
    v = read_verdict(load_model(str(tiny_retrieval)).fingerprint)
    assert v is not None and v.passed == out["verdict"]["passed"]


def test_eval_blend_on_a_builtin_has_no_accuracy_but_agreement(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    assert blend_eval.main(["--model", "tiny", "--prompts", "2", "--docs", "3", "--doc-tokens", "24", "--no-verdict",
                            "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "generic" and out["methods"]["naive"]["accuracy"] is None and out["verdict"]["path"] is None
    assert out["claims"] == []  # nothing to claim without answers


def test_a_run_cut_by_its_budget_resumes_from_the_cache_and_computes_nothing_twice(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    argv = ["--model", "tiny", "--prompts", "3", "--docs", "2", "--doc-tokens", "24", "--no-verdict", "--json",
            "--cache", str(tmp_path / "c")]
    assert blend_eval.main(argv + ["--budget-s", "0"]) == 0
    cut = json.loads(capsys.readouterr().out)
    assert cut["prompts_done"] == 1  # the budget is checked between prompts: the first always runs
    rows = (tmp_path / "c" / "results-seg2-cl1-k16.jsonl").read_text().splitlines()
    assert blend_eval.main(argv) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["prompts_done"] == 3 and done["methods"]["full"]["prompts"] == 3
    after = (tmp_path / "c" / "results-seg2-cl1-k16.jsonl").read_text().splitlines()
    assert after[: len(rows)] == rows and len({(json.loads(r)["case"], json.loads(r)["method"]) for r in after}) == len(after)
    assert len(list((tmp_path / "c" / "full").glob("*.safetensors"))) == 3


@pytest.mark.parametrize("flags, message", [
    (["--ratios", "abc"], "--ratios must be a comma list"), (["--ratios=-0.1,0.15"], "--ratios must be in [0, 1]"),
    (["--ratios", "1.5,0.15"], "--ratios must be in [0, 1]"), (["--ratios", "nan,0.15"], "--ratios must be in [0, 1]"),
    (["--prompts", "0"], "--prompts must be >= 1"), (["--prompts", "-3"], "--prompts must be >= 1"),
    (["--docs", "0"], "--docs must be >= 1"), (["--docs", "-1"], "--docs must be >= 1"),
    (["--doc-tokens", "0"], "--doc-tokens must be >= 1"), (["--answer-tokens", "0"], "--answer-tokens must be >= 1"),
    (["--check-layer", "-1"], "--check-layer must be >= 0"), (["--threads", "0"], "--threads must be >= 1"),
    (["--budget-s", "-1"], "--budget-s must be >= 0"), (["--out", "."], "is a directory"),
])
def test_bad_flags_are_refused_before_the_model_loads_and_write_nothing(monkeypatch, tmp_path, capsys, flags,
                                                                          message) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(blend_eval, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert blend_eval.main(["--model", "tiny", *flags, "--json"]) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["error"] == "InvalidInput" and message in err["message"]
    assert list(tmp_path.iterdir()) == []  # no cache, no verdict (a run of 0 prompts wrote a failing one)


def test_a_check_layer_past_the_model_and_unwritable_paths_are_one_line_errors(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    (tmp_path / "file").write_text("x")
    small = ["--model", "tiny", "--prompts", "1", "--docs", "1", "--doc-tokens", "8", "--no-verdict", "--json"]
    for flags, message in ((["--check-layer", "99", "--no-cache"], "--check-layer must be in 0..1"),
                           (["--cache", str(tmp_path / "file")], "Not a directory"),
                           (["--no-cache", "--out", str(tmp_path / "file" / "x.json")], "File exists")):
        assert blend_eval.main(small + flags) == 2
        err = json.loads(capsys.readouterr().out)
        assert message in err["message"], err


def test_paired_statistics() -> None:
    from kdn.lab.paired import mcnemar, sign_test, wilson

    t = mcnemar([True] * 10 + [False] * 5, [False] * 10 + [False] * 5)
    assert (t.a_only, t.b_only) == (10, 0) and abs(t.p_value - 2 / 1024) < 1e-12
    assert mcnemar([True, False], [True, False]).p_value == 1.0
    lo, hi = wilson(80, 100)
    assert 0.71 < lo < 0.72 and 0.86 < hi < 0.87
    s = sign_test([0.1] * 10 + [0.5, 0.5], [0.2] * 10 + [0.5, 0.4])  # 10 lower, 1 tie, 1 higher
    assert (s.n, s.a_only, s.b_only) == (12, 10, 1) and abs(s.p_value - 2 * 12 / 2048) < 1e-12
    assert sign_test([0.3], [0.3]).p_value == 1.0


def test_the_random_control_is_judged_by_the_per_prompt_kl_not_by_the_answers() -> None:
    from kdn.lab.blend_eval import claims

    def method(acc: float, kl: float, **extra: object) -> dict:
        return {"accuracy": acc, "kl": kl, **extra}

    def control(lower_this: int, lower_other: int, p: float) -> list[dict]:
        m = {"full": method(0.85, 0.0), "naive": method(0.6, 0.6), "blend@0.15": method(0.83, 0.08),
             "random@0.15": method(0.83, 0.12, **{"kl_vs_blend@0.15": {"lower_this": lower_this,
                                                                       "lower_other": lower_other, "p": p}})}
        return [c for c in claims(m) if c["what"].startswith("random@15%")]

    [c] = control(40, 200, 1e-20)  # same accuracy, further from full prefill in most prompts
    assert c["met"] and c["value"] == 1e-20
    assert not control(200, 40, 1e-20)[0]["met"]  # closer to full prefill than the deviation rule
    assert not control(110, 130, 0.2)[0]["met"]  # not clearly different


def test_needle_prompts_ask_a_unique_line_of_one_file_at_every_position(tiny_model) -> None:
    from kdn.lab.blend_tasks import NeedleSpec, document_pool, needle_cases
    from kdn.lab.reference import corpus_split

    cs = corpus_split()
    tok = tiny_model.tokenizer
    pool = document_pool(tok, cs.heldout[:10], cs.root, doc_tokens=200, per_file=3)
    assert len({d.name for d in pool}) >= 5 and all(len(d.tokens) == 200 for d in pool)
    spec = NeedleSpec(n_docs=4, doc_tokens=200, cue_tokens=16, answer_tokens=4, min_cue_chars=8)  # byte tokens
    cases = needle_cases(tok, pool, 8, spec, seed=1)
    assert [c["needle"] for c in cases] == [0, 1, 2, 3, 0, 1, 2, 3]
    for c in cases:
        doc = c["docs"][c["needle"]]
        cue = c["question"][-16:]
        hay = sum(c["docs"], [])
        at = [i for i in range(len(hay) - 15) if hay[i:i + 16] == cue]
        assert len(at) == 1  # unambiguous
        j = next(i for i in range(len(doc) - 15) if doc[i:i + 16] == cue)
        assert doc[j + 16:j + 20] == c["answer"]
        assert "\n" in tok.decode(doc[j - 1:j]) and tok.decode(doc[j:j + 1]).strip()  # the first code token of a line
    assert needle_cases(tok, pool, 8, spec, seed=1) == cases  # seeded
