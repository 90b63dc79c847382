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
    assert blend_eval.main(["--model", str(tiny_retrieval), "--prompts", "4", "--docs", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["task"] == "retrieval" and out["prompts"] == 4
    names = set(out["methods"])
    assert {"full", "prefix-only", "naive", "first-16", "blend@0.05", "blend@0.1", "blend@0.15", "blend@0.3"} == names
    full = out["methods"]["full"]
    assert full["agreement"] == 1.0 and full["kl"] == 0.0
    assert out["methods"]["prefix-only"]["agreement"] == 1.0  # exact reuse is exact
    assert 0.14 <= out["methods"]["blend@0.15"]["recomputed"] <= 0.2
    v = read_verdict(load_model(str(tiny_retrieval)).fingerprint)
    assert v is not None and v.passed == out["verdict"]["passed"]


def test_eval_blend_on_a_builtin_has_no_accuracy_but_agreement(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path))
    assert blend_eval.main(["--model", "tiny", "--prompts", "2", "--docs", "3", "--doc-tokens", "24", "--no-verdict",
                            "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["methods"]["naive"]["accuracy"] is None and out["verdict"]["path"] is None
