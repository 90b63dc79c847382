"""The quality harness: raw vs decoded KV through the real container, judged by the model's outputs,
and the documents and questions it reads (kdn.lab.docqa)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kdn.errors import InvalidInput, UnknownCodec
from kdn.lab import docqa
from kdn.lab.quality import (
    EvalSetup,
    _answer_like,
    _cache,
    _greedy,
    evaluate,
    format_table,
    load_documents,
    load_models,
    reference_run,
)

SOURCE_A = '''"""A module."""
from collections import OrderedDict
LIMIT = 4096
NAME = "spam-and-eggs"


class Base:
    def run(self, x, depth=17):
        raise ValueError(x)


class Child(Base):
    def jump(self):
        return 1
''' * 1 + "\n".join(f"def helper_{i}(a, b={100 + i}):\n    return a + b\n" for i in range(40))

SOURCE_B = "\n".join(f"class Thing{i}(dict):\n    def get_{i}(self):\n        return {i}\n" for i in range(40))


def _setup(**kw) -> EvalSetup:
    return EvalSetup(**{"contexts": (64, 128), "documents": 2, "continuation": 8, "kv_dtypes": ("float16",),
                        "questions": 3, "answer_tokens": 4, "timing_repeats": 1, **kw})


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("src")
    (root / "a.py").write_text(SOURCE_A)
    (root / "b.py").write_text(SOURCE_B)
    return root, [root / "a.py", root / "b.py"]


@pytest.fixture(scope="module")
def models():
    return load_models("tiny", ("float16", "bfloat16"), 32)


@pytest.fixture(scope="module")
def docs(models, files):
    root, paths = files
    return load_documents(models["float16"], _setup(), paths, root)


def test_lossless_codecs_change_nothing(models, docs) -> None:
    report = evaluate(models, ["raw", "zstd"], _setup(kv_dtypes=("float16", "bfloat16")), docs)
    assert {(r.kv_dtype, r.context) for r in report.results} == {(d, c) for d in ("float16", "bfloat16") for c in (64, 128)}
    for r in report.results:
        assert r.identical and r.top1_agreement == 1.0 and r.mean_kl == 0.0 and r.ppl_change == 0.0
        assert r.predictions == 2 * 8 and r.documents == 2
        assert r.accuracy == r.accuracy_raw and r.changed == 0 and r.mcnemar_p == 1.0
    raw = report.get("raw", "float16", 128)
    assert 0.95 < raw.size_ratio <= 1.0  # the tensor's bytes plus framing
    assert raw.raw_bytes == 2 * 2 * 2 * 2 * 128 * 32 * 2  # documents·L·2·H·T·D·2 bytes
    assert report.get("zstd:3", "bfloat16", 64).size_ratio > 1.0


def test_lossy_codecs_measured_not_assumed(models, docs) -> None:
    report = evaluate(models, ["int8", "kvq:k6v6", "kvq:k3v3"], _setup(), docs)
    int8, fine, coarse = (report.get(c, "float16", 128) for c in ("int8", "kvq:k6v6", "kvq:k3v3"))
    assert not coarse.identical and coarse.lossy
    assert coarse.mean_kl > fine.mean_kl > 0.0  # fewer bits, further from raw's distribution
    assert coarse.size_ratio > fine.size_ratio > int8.size_ratio * 0.9 > 1.5
    assert all(r.decode_gbps > 0 and r.encode_gbps > 0 for r in report.results)
    assert "kvq:k3v3" in format_table(report.results)


def test_quality_tracks_the_kv_not_the_codec_name(models, docs, monkeypatch: pytest.MonkeyPatch) -> None:
    """Garbage KV must show up as disagreement: the harness really conditions on decoded KV."""
    from kdn.codecs import kvq

    real = kvq.KvqCodec.decode
    monkeypatch.setattr(kvq.KvqCodec, "decode", lambda self, p, info: real(self, p, info) * 0 + 3.0)
    r = evaluate(models, ["kvq:k6v6"], _setup(), docs).get("kvq:k6v6", "float16", 128)
    assert r.mean_kl > 1e-3 and not r.identical


def test_bf16_kv_is_the_bf16_models_own(models, docs) -> None:
    assert next(models["bfloat16"].model.parameters()).dtype == torch.bfloat16
    assert next(models["float16"].model.parameters()).dtype == torch.float32  # fp16 KV: fp32 prefill, rounded
    run = reference_run(models["bfloat16"], docs[0], "bfloat16", _setup())
    assert all(c.dtype == torch.bfloat16 for c in run.chunks) and len(run.chunks) == 128 // 32
    assert [r.context for r in run.refs] == [128, 64]


def test_answer_shortcut_is_greedy(models, docs) -> None:
    """The teacher-forced shortcut gives exactly what token-by-token greedy decoding gives."""
    lm = models["float16"]
    run = reference_run(lm, docs[0], "float16", _setup())
    prompt = torch.tensor([5, 6, 7, 8], dtype=torch.long)
    raw = _cache(lm, run.chunks)
    ref = _greedy(lm, raw, prompt, 6)
    assert _answer_like(lm, raw, prompt, ref, 6) == ref
    noisy = _cache(lm, [c + torch.randn_like(c.float()).to(c.dtype) for c in run.chunks])
    assert _answer_like(lm, noisy, prompt, ref, 6) == _greedy(lm, noisy, prompt, 6)


def test_windows_bounded_by_model_positions(models, files) -> None:
    root, paths = files
    with pytest.raises(InvalidInput, match="positions"):
        load_documents(models["float16"], _setup(contexts=(10_000,)), paths, root)
    with pytest.raises(InvalidInput, match="no document"):
        load_documents(models["float16"], _setup(contexts=(4096,)), paths[:1], root)
    with pytest.raises(UnknownCodec):
        evaluate(models, ["nope"], _setup(), [])
    with pytest.raises(InvalidInput):
        EvalSetup(kv_dtypes=("float8",))


def test_facts_and_questions(models) -> None:
    facts = {(kind, answer) for _, kind, _, _, answer, _ in docqa.file_facts(SOURCE_A)}
    assert {("base", "Base"), ("const", "4096"), ("const", "spam-and-eggs"), ("import", "collections"),
            ("default", "17"), ("raises", "ValueError"), ("method", "Child")} <= facts
    assert not any(answer in docqa.TRIVIAL_ANSWERS for _, answer in facts)
    assert docqa.file_facts("def broken(:\n") == []
    tok = models["float16"].tokenizer
    doc = docqa.Document("a.py", SOURCE_A, tuple(
        docqa.Fact(kind, subject, q, a, SOURCE_A.index("\n", _offset(SOURCE_A, line)), lead)
        for line, kind, subject, q, a, lead in docqa.file_facts(SOURCE_A)))
    short = docqa.questions_for(tok, doc, 120, 50, "text")
    assert short and all(q.token_end <= 120 for q in short)  # only what the first 120 tokens hold
    longer = docqa.questions_for(tok, doc, 800, 50, "text")
    assert len(longer) > len(short)
    assert len({q.question for q in longer}) == len(longer)
    assert len(docqa.questions_for(tok, doc, 800, 3, "text")) == 3


def _offset(text: str, line: int) -> int:
    return sum(len(ln) + 1 for ln in text.split("\n")[: line - 1])


def test_grading_and_mcnemar() -> None:
    assert docqa.is_correct("The class is `Base`.", "Base")
    assert docqa.is_correct("it is 'spam-and-eggs'", "spam-and-eggs")
    assert not docqa.is_correct("BaseClass", "Base") and not docqa.is_correct("4096000", "4096")
    assert not docqa.is_correct("anything", "")
    assert docqa.mcnemar_p(0, 0) == 1.0 and docqa.mcnemar_p(3, 3) == 1.0
    assert docqa.mcnemar_p(0, 6) == pytest.approx(2 / 64)
    assert docqa.mcnemar_p(1, 9) == pytest.approx(2 * 11 / 1024)


def test_calibration_and_test_files_never_overlap(files) -> None:
    root, paths = files
    cal, test = docqa.split_files(paths, root, "calibration"), docqa.split_files(paths, root, "test")
    assert sorted(cal + test) == sorted(paths) and not set(cal) & set(test)
    assert docqa.is_calibration("a.py") == docqa.is_calibration("a.py")
    _, real_cal = docqa.heldout_files("calibration")
    _, real_test = docqa.heldout_files("test")
    assert real_cal and real_test and not set(real_cal) & set(real_test)
    with pytest.raises(InvalidInput):
        docqa.split_files(paths, root, "train")


def test_cli_json(files, capsys) -> None:
    from kdn.lab.quality import main

    _, paths = files
    argv = ["--model", "tiny", "--chunk-size", "32", "--contexts", "64", "--documents", "1", "--continuation", "8",
            "--questions", "2", "--answer-tokens", "3", "--kv-dtype", "float16", "--timing-repeats", "1",
            "--text", str(paths[0]), "--text", str(paths[1])]
    rc = main([*argv, "--codec", "raw,kvq:k4v4", "--codec", "int8", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["codec"] for r in out["results"]] == ["raw", "kvq:k4v4", "int8"]
    assert out["documents"] and out["setup"]["contexts"] == [64]
    assert main(["--model", "tiny", "--codec", "kvq:q9"]) == 2
    assert "unknown kvq level" in capsys.readouterr().err
    assert main([*argv[:-4], "--text", "/nonexistent.py", "--codec", "raw"]) == 2


def test_calibration_spends_bits_where_the_model_is_sensitive(models, docs) -> None:
    from kdn.codecs.kvq import LEVELS
    from kdn.lab.quality import calibrate_kvq

    setup = _setup(questions=0)
    runs = [reference_run(models["float16"], d, "float16", setup) for d in docs]
    cal = calibrate_kvq(runs, "k3v3", setup)
    assert cal.probe_bits == 2 and len(cal.kl) == 2 and all(k > 0 and v > 0 for k, v in cal.kl)
    flat = sorted(((cal.kl[l][s], l, s) for l in range(2) for s in (0, 1)), reverse=True)
    _, layer, slot = flat[0]
    assert cal.plan.table[layer][slot] == LEVELS["k3v3"][slot] + 1  # the most sensitive slot got a bit
    assert cal.plan.format == 2 and cal.plan.sink > 0
    with pytest.raises(InvalidInput):
        calibrate_kvq(runs, "q9", setup)
