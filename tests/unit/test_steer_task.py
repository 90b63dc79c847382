"""The steering task on the trained model (kdn.lab.steer_task): haystacks, questions, marks."""

from __future__ import annotations

import re

import pytest

from kdn.lab.steer_task import (DEPTHS, NOTE_RULE, SourcePool, ceiling_question, char_spans_to_tokens, make_haystack,
                                mark_chars, split_files)
from kdn.models import load_model
from kdn.prompts import request_tokens


@pytest.fixture(scope="module")
def tok():
    return load_model("smollm2-135m").tokenizer


@pytest.fixture(scope="module")
def pools(tok):
    return SourcePool(tok, "calibration"), SourcePool(tok, "test")


def test_calibration_and_test_haystacks_never_share_a_file(pools) -> None:
    _, cal = split_files("calibration")
    _, test = split_files("test")
    assert cal and test and not set(cal) & set(test)
    cal_pool, test_pool = pools
    seen = {"calibration": set(), "test": set()}
    for pool in pools:
        for i in range(4):
            seen[pool.split] |= set(make_haystack(pool, length=900, n_docs=5, seed=0, index=i).files)
    assert seen["calibration"] and seen["test"] and not seen["calibration"] & seen["test"]


def test_a_haystack_holds_one_lookalike_note_per_document_and_asks_at_every_depth(tok, pools) -> None:
    _, pool = pools
    hs = make_haystack(pool, length=900, n_docs=5, seed=0, index=3)
    assert hs == make_haystack(pool, length=900, n_docs=5, seed=0, index=3)  # seeded
    assert hs != make_haystack(pool, length=900, n_docs=5, seed=0, index=4)
    assert 700 <= len(hs.tokens) <= 1200
    notes = [ln for ln in hs.text.split("\n") if re.search(NOTE_RULE, ln)]
    assert len(notes) == 5 and len(set(hs.vaults)) == 5 and len(set(hs.codes)) == 5
    for d, doc in enumerate(hs.docs):
        assert f"the access code for the {hs.vaults[d]} vault is {hs.codes[d]}." in doc
    assert [q.depth for q in hs.questions] == list(DEPTHS)
    assert [q.doc for q in hs.questions] == [0, 1, 2, 3, 4]
    for q in hs.questions:
        assert tok.decode(q.answer) == q.code and len(q.answer) == 4  # four digit tokens
        req = request_tokens(tok, hs.text, f"What is the access code for the {q.vault} vault?", "system")
        assert list(hs.tokens) + list(q.tail) == req + tok.encode(f"The access code for the {q.vault} vault is ") + list(q.answer[:-1])
        doc_tokens, cq = ceiling_question(tok, hs, q)
        assert len(doc_tokens) < len(hs.tokens) and cq.answer == q.answer


def test_marks_of_each_kind(tok, pools) -> None:
    _, pool = pools
    hs = make_haystack(pool, length=900, n_docs=5, seed=0, index=1)
    q = hs.questions[2]
    text = hs.text
    realistic = mark_chars(hs, "realistic", q)
    assert [text[s:e] for s, e in realistic] == [ln for ln in text.split("\n") if ln.startswith("# NOTE:")]
    assert mark_chars(hs, "realistic", hs.questions[0]) == realistic  # question-blind
    (oracle,) = mark_chars(hs, "oracle", q)
    assert q.vault in text[oracle[0]:oracle[1]] and q.code in text[oracle[0]:oracle[1]]
    (wrong,) = mark_chars(hs, "wrong", q)
    assert wrong in realistic and wrong != oracle
    rnd = mark_chars(hs, "random", q)
    assert len(rnd) == len(realistic) and not set(rnd) & set(realistic)
    assert mark_chars(hs, "random", hs.questions[4]) == rnd  # question-blind
    heads = mark_chars(hs, "headings", q)
    assert heads and all(re.match(r"(# file: |\s*(async\s+)?def |\s*class )", text[s:e]) for s, e in heads)
    assert not set(heads) & set(realistic)
    assert mark_chars(hs, "everything", q) == [(0, len(text))]
    spans = char_spans_to_tokens(tok, text, [oracle])
    (s, e), = spans
    assert q.code in tok.decode(list(hs.tokens[s:e])) and e - s < 40
    with pytest.raises(Exception, match="unknown mark kind"):
        mark_chars(hs, "psychic", q)
