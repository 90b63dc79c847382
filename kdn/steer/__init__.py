"""Steered KV: a document's stored KV edited at ingest so that later prompts read it differently.

A *steer spec* (:class:`SteerSpec`) names one steered variant of a document: the ``method``, the
operator's ``marks`` (token spans ``[start, end)`` of the document) and a ``strength``. Two methods
(:mod:`kdn.steer.methods`), both of which leave the model's attention untouched at reuse time —
only the stored K/V differ, so any engine that can load KV can use them:

- ``key-edit`` (PASTA/SEKA-style): the keys of the marked tokens, in a few heads chosen by a
  calibration, get a vector added along each head's mean query direction, restricted to the
  lowest-frequency rotary dimensions (which barely rotate over the distances a prompt spans), so
  every later query near the head's typical query gives the marked tokens about ``strength`` more
  nats of attention logit. Needs a :class:`~kdn.steer.methods.KeyEditCalibration` for the model;
  its digest is part of the spec (the same marks under another calibration are another variant).
- ``re-read`` (LLMSteer-style, query-independent): the model reads the document (or only its marked
  spans) a second time right after the first; the stored KV of those tokens is the second
  reading's, rotated back to the single copy's positions (:mod:`kdn.blend.rope`), so the prompt
  still reads as one copy and costs nothing more at reuse.

Keys: a steered variant is part of the key. Its chain starts from its own root,
``steer_root(spec) = BLAKE2b-256("kdn/steer/root/v1" ‖ canonical spec)`` instead of
:data:`kdn.keys.ROOT_KEY`, so every chunk key of a steered chain differs from the plain chain's and
from every other variant's; the plain chain (root ``ROOT_KEY``) is byte-for-byte what it always
was. A client gets a steered variant only by naming it (its spec, or the variant id — the root's
hex); by default it computes plain keys. Each steered artifact carries its spec (method, marks,
strength, calibration) as canonical JSON in the container header's ``steer`` field; plain
artifacts leave it empty, and a reader that expects plain refuses a steered artifact.

Invariants:
- plain keys never depend on anything in this module;
- equal variant ids imply equal canonical specs (method, marks, strength, calibration digest);
- a steered artifact's header names its spec; a steered result is never stored under a plain key.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import regex

from kdn.errors import InvalidInput
from kdn.keys import KEY_BYTES, ChunkKey, ROOT_KEY, tokens_u32

__all__ = [
    "Emphasis", "MAX_STRENGTH", "SteerSpec", "chars_to_tokens", "document_digest", "marks_from_regex", "parse_variant",
    "regex_lines", "steer_root", "steering_line",
]

METHODS = ("key-edit", "re-read")
MAX_STRENGTH = 8.0  # nats of attention logit added (key-edit); beyond this a head sees nothing else
MAX_MARKS = 4096
SPEC_VERSION = 1
_ROOT_PERSON = b"kdn/steer/root/v1"


@dataclass(frozen=True, slots=True)
class SteerSpec:
    """One steered variant of a document.

    ``marks``: token spans ``[start, end)`` of the document, merged and sorted on construction.
    ``key-edit`` needs at least one mark and a strength in ``(0, MAX_STRENGTH]`` nats;
    ``re-read`` with no marks re-reads the whole document, with marks only those spans, and takes
    no strength (it is stored as 1). ``calibration``: digest of the key-edit calibration ("" for
    re-read). ``document``: :func:`document_digest` of the stored tokens the spec was applied to
    ("" until :meth:`bound`). A steered chunk's KV depends on the whole document (re-read reads
    the marks again after all of it; key-edit's ramp profile scales by the document's length),
    while its key hashes only the tokens up to it: a bound spec gives every document its own
    variant root, so two documents that share their first chunks never share a steered chunk.
    """

    method: str
    marks: tuple[tuple[int, int], ...] = ()
    strength: float = 1.0
    calibration: str = ""
    document: str = ""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidInput(f"unknown steer method {self.method!r}; choose one of {', '.join(METHODS)}")
        marks = merge_marks(self.marks)
        object.__setattr__(self, "marks", marks)
        if self.method == "key-edit":
            if not marks:
                raise InvalidInput("key-edit needs at least one marked span (what should get more attention)")
            s = _strength(self.strength)
            if not (0.0 < s <= MAX_STRENGTH):  # also refuses NaN
                raise InvalidInput(f"key-edit strength must be in (0, {MAX_STRENGTH:g}] nats, got {self.strength!r}")
            object.__setattr__(self, "strength", s)  # as the canonical spec (and so the header) names it
            if not re.fullmatch(r"[0-9a-f]{16,64}", self.calibration):
                raise InvalidInput("key-edit needs the digest of the model's key-edit calibration (hex); "
                                   "run `kdn eval-steer --model MODEL --out DIR` to calibrate")
        else:
            if float(self.strength) != 1.0:
                raise InvalidInput(f"re-read takes no strength (reads the marked text once more), got {self.strength!r}")
            object.__setattr__(self, "strength", 1.0)
            if self.calibration:
                raise InvalidInput("re-read takes no calibration")
        if self.document and not re.fullmatch(r"[0-9a-f]{32}", self.document):
            raise InvalidInput("a steer spec's document is the 32-hex-digit digest of the document's stored tokens")

    def bound(self, tokens: Sequence[int]) -> "SteerSpec":
        """This spec applied to the document whose stored tokens are ``tokens`` (its own variant)."""
        return replace(self, document=document_digest(tokens))

    def check_fits(self, n_tokens: int) -> None:
        """Refuse marks that reach past a document of ``n_tokens`` tokens."""
        for s, e in self.marks:
            if e > n_tokens:
                raise InvalidInput(f"marked span [{s}, {e}) is out of range: the document has {n_tokens} tokens")

    def canonical(self) -> str:
        """The spec as canonical JSON (sorted keys, no spaces): what the key hashes and the header holds."""
        d: dict[str, Any] = {"v": SPEC_VERSION, "method": self.method, "marks": [list(m) for m in self.marks],
                             "strength": _strength(self.strength), "calibration": self.calibration}
        if self.document:  # absent from unbound specs, whose ids are what they always were
            d["document"] = self.document
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_canonical(cls, text: str) -> "SteerSpec":
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise InvalidInput("malformed steer spec: not a JSON object")
            if d.get("v") != SPEC_VERSION:
                raise InvalidInput(f"steer spec version {d.get('v')!r} is not {SPEC_VERSION}")
            document = d.get("document", "")
            if not isinstance(document, str):
                raise InvalidInput("malformed steer spec: document is not a string")
            return cls(d["method"], tuple(tuple(m) for m in d["marks"]), float(d["strength"]), d["calibration"], document)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            if isinstance(exc, InvalidInput):
                raise
            raise InvalidInput(f"malformed steer spec: {exc}") from exc

    @property
    def variant_id(self) -> str:
        """The hex of :func:`steer_root`: how a client names this variant."""
        return bytes(steer_root(self)).hex()

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "marks": [list(m) for m in self.marks], "strength": self.strength,
                "calibration": self.calibration, "document": self.document, "variant": self.variant_id}


def document_digest(tokens: Sequence[int]) -> str:
    """BLAKE2b-128 hex of ``tokens`` as little-endian u32 (:func:`kdn.keys.tokens_u32`)."""
    return hashlib.blake2b(tokens_u32(tokens).tobytes(), digest_size=16).hexdigest()


def _strength(value: float) -> float:
    """A strength as the canonical spec holds it (6 decimals): a spec is computed with, and its
    header names, this value, so one that rounds to 0 is refused rather than stored unreadable."""
    return round(float(value), 6)


def merge_marks(marks: Sequence[Sequence[int]]) -> tuple[tuple[int, int], ...]:
    if len(marks) > MAX_MARKS:
        raise InvalidInput(f"at most {MAX_MARKS} marked spans, got {len(marks)}")
    spans = []
    for m in marks:
        if len(m) != 2:
            raise InvalidInput(f"a marked span is (start, end), got {tuple(m)!r}")
        s, e = m
        if isinstance(s, bool) or isinstance(e, bool) or not isinstance(s, int) or not isinstance(e, int):
            raise InvalidInput(f"a marked span holds two integers, got {tuple(m)!r}")
        if s < 0 or e <= s:
            raise InvalidInput(f"marked span [{s}, {e}) is empty or negative")
        spans.append((s, e))
    spans.sort()
    out: list[tuple[int, int]] = []
    for s, e in spans:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return tuple(out)


def steer_root(spec: SteerSpec | None) -> ChunkKey:
    """The chain root of a variant: :data:`kdn.keys.ROOT_KEY` for plain (``None``)."""
    if spec is None:
        return ROOT_KEY
    return ChunkKey(hashlib.blake2b(_ROOT_PERSON + spec.canonical().encode(), digest_size=KEY_BYTES).digest())


def parse_variant(value: str | None) -> ChunkKey:
    """A variant id from a client (64 hex digits, or "" / "plain" / None for plain) as a chain root."""
    if value is None or value in ("", "plain"):
        return ROOT_KEY
    try:
        raw = bytes.fromhex(value)
    except ValueError as exc:
        raise InvalidInput(f"malformed steer variant id {value[:80]!r}: not hex") from exc
    if len(raw) != KEY_BYTES:
        raise InvalidInput(f"malformed steer variant id: {len(raw)} bytes, expected {KEY_BYTES}")
    return ChunkKey(raw)


def marks_from_regex(text: str, pattern: str, offsets: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Token spans of the lines of ``text`` that match ``pattern`` (searched per line, :func:`regex_lines`).

    ``offsets``: each token's character span in ``text`` (a fast tokenizer's offset mapping). A
    token is marked when it overlaps a matching line.
    """
    return chars_to_tokens(regex_lines(text, pattern), offsets)


REGEX_BUDGET_S = 2.0
"""Longest an operator's regex may run over one document: a pattern that backtracks without end
(``^(a+)+$``) is refused, never left pinning an origin thread."""


def compile_regex(pattern: str) -> "regex.Pattern[str]":
    """``pattern`` compiled (the ``regex`` package, whose searches take a time bound; its default
    syntax is :mod:`re`'s); a bad one raises :class:`InvalidInput`."""
    try:
        return regex.compile(pattern)
    except (regex.error, TypeError) as exc:
        raise InvalidInput(f"bad --emphasize regex {pattern!r}: {exc}") from exc


def regex_lines(text: str, pattern: str, budget_s: float = REGEX_BUDGET_S) -> list[tuple[int, int]]:
    """Character spans of the lines of ``text`` (without their line end) that match ``pattern``;
    :class:`InvalidInput` when it matches none, or when matching takes over ``budget_s`` in all."""
    rx = compile_regex(pattern)
    lines, pos = [], 0
    deadline = time.monotonic() + budget_s
    for line in text.splitlines(keepends=True):
        body = line.rstrip("\r\n")
        try:
            found = rx.search(body, timeout=max(1e-3, deadline - time.monotonic()))
        except TimeoutError:
            raise InvalidInput(f"regex {pattern!r} ran past {budget_s:g} s on this document (it backtracks without "
                               "end?): nothing emphasized") from None
        if found:
            lines.append((pos, pos + len(body)))
        pos += len(line)
    if not lines:
        raise InvalidInput(f"regex {pattern!r} matches no line of the document: nothing to emphasize")
    return lines


def chars_to_tokens(char_spans: Sequence[tuple[int, int]], offsets: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Token spans covering character spans (a token is in when its characters overlap the span)."""
    out = []
    for cs, ce in char_spans:
        toks = [i for i, (ts, te) in enumerate(offsets) if ts < ce and te > cs]
        if toks:
            out.append((toks[0], toks[-1] + 1))
    if not out:
        raise InvalidInput("the marked text covers no token of the document")
    return merge_marks(out)


@dataclass(frozen=True, slots=True)
class Emphasis:
    """What an operator marks in every document of one ingest (before it meets a document)."""

    method: str
    regex: str = ""
    spans: tuple[tuple[int, int], ...] = ()  # token spans of the document
    strength: float | None = None  # key-edit: nats (default: the calibrated strength)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidInput(f"unknown --emphasize method {self.method!r}; choose one of {', '.join(METHODS)}")
        if self.regex and self.spans:
            raise InvalidInput("--emphasize-regex and --emphasize-spans exclude each other")
        if self.regex:
            compile_regex(self.regex)
        object.__setattr__(self, "spans", merge_marks(self.spans))
        if self.method == "key-edit":
            if not self.regex and not self.spans:
                raise InvalidInput("key-edit needs marks: --emphasize-regex RX or --emphasize-spans S:E,...")
            if self.strength is not None and not (0.0 < _strength(self.strength) <= MAX_STRENGTH):
                raise InvalidInput(f"--emphasize-strength must be in (0, {MAX_STRENGTH:g}] nats, got {self.strength!r}")
        elif self.strength is not None:
            raise InvalidInput("re-read takes no --emphasize-strength (it reads the marked text once more)")

    @staticmethod
    def parse_spans(text: str) -> tuple[tuple[int, int], ...]:
        """``"0:10,20:30"`` -> ``((0, 10), (20, 30))`` (token spans, end exclusive)."""
        out = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            a, sep, b = part.partition(":")
            try:
                if not sep:
                    raise ValueError
                out.append((int(a), int(b)))
            except ValueError:
                raise InvalidInput(f"bad --emphasize-spans item {part!r}: want START:END token indices") from None
        if not out:
            raise InvalidInput("--emphasize-spans is empty")
        return merge_marks(out)

    def to_json(self) -> str:
        return json.dumps({"method": self.method, "regex": self.regex, "spans": [list(s) for s in self.spans],
                           "strength": self.strength})

    @classmethod
    def from_json(cls, text: str) -> "Emphasis":
        try:
            d = json.loads(text)
            return cls(d["method"], d.get("regex", ""), tuple(tuple(s) for s in d.get("spans", ())), d.get("strength"))
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, InvalidInput):
                raise
            raise InvalidInput(f"malformed emphasis: {exc}") from exc


def steering_line(s: dict[str, Any]) -> str:
    """One model's steering as an origin reports it (:func:`kdn.origin.steer.steering_details`), in
    a line (``kdn stats`` on an origin)."""
    ke = s.get("key_edit")
    line = f"{s.get('variants', 0)} document(s) with a steered variant; methods {', '.join(s.get('methods', []))}"
    if not ke:
        return line + (f" ({s['problem']})" if s.get("problem") else "")
    line += f"; key-edit {ke['profile']} {ke['strength']:g} nats on {ke['heads']} heads (layers {ke['layers']})"
    m = ke.get("measured")
    if m:
        weak = m.get("weak_depths") or []
        gains = ", ".join(f"{d}: {m.get('realistic', {}).get(d, 0):+.1f}" for d in weak)
        line += f"; measured on {m.get('haystacks')} held-out haystacks, realistic marks at weak depths ({gains}) points"
    return line
