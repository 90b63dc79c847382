"""Probes of the simulator's external inputs (scenario YAML, trace files, ``kdn simulate`` options):
each bad input is one clear error naming the file and the field (exit code 2 from the CLI), never a
traceback, a hang or a memory blow-up. Inputs that used to hang or exhaust memory run in a child
process under a time and address-space limit."""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdn.errors import ConfigError
from kdn.simulator import cli
from kdn.simulator.geo import CityIndex
from kdn.simulator.presets import load_presets
from kdn.simulator.runner import prepare
from kdn.simulator.scenario import REPO_ROOT, load_scenario

TINY: dict[str, Any] = {
    "name": "probe",
    "seed": 1,
    "model": "qwen2.5-7b",
    "gpu": "a100-80gb",
    "topology": {
        "origins": [{"city": "Frankfurt am Main", "uplink_gbps": 40}],
        "regions": [{"name": "uk", "city": "London, GB"}, {"name": "us", "city": "New York City"}],
    },
    "workload": {"kind": "synthetic", "requests": 50, "duration_s": 100, "documents": 20},
    "cache": {"edge_cache_gb": 16},
}
GOOD_TRACE = (
    '{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [0, 1, 2]}\n'
    '{"timestamp": 10, "input_length": 1600, "output_length": 1, "hash_ids": [0, 1, 2, 3]}\n'
)


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "kdn-cache"))


@pytest.fixture(scope="module")
def ctx() -> dict[str, Any]:
    return {"cities": CityIndex.default(), "presets": load_presets()}


def scenario(tmp_path: Path, mutate: Any = None, name: str = "s.yaml") -> Path:
    data = copy.deepcopy(TINY)
    if mutate is not None:
        mutate(data)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def simulate(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    rc = cli.main(["simulate", str(path), "--out", str(tmp_path / "out"), "--no-progress", "--no-sweep", "--policy", "nearest_edge", *extra])
    return rc, capsys.readouterr().err


def refused(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    """The CLI's one-line error for ``path``: exit code 2, the file named, nothing simulated."""
    rc, err = simulate(path, tmp_path, capsys, *extra)
    assert rc == 2, err
    assert err.startswith("kdn simulate: error:") and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    return err


def run_child(path: Path, tmp_path: Path, *, timeout_s: float = 60, mem_bytes: int = 3 << 30) -> subprocess.CompletedProcess[str]:
    """``kdn simulate path`` in a child with an address-space limit and a wall-clock timeout."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({mem_bytes}, {mem_bytes}))\n"
        "from kdn.simulator.cli import main\n"
        f"sys.exit(main(['simulate', {str(path)!r}, '--out', {str(tmp_path / 'out')!r}, '--no-progress', '--no-sweep', '--policy', 'nearest_edge']))\n"
    )
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "KDN_CACHE": str(tmp_path / "kdn-cache")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT, env=env)


# -- scenario files ---------------------------------------------------------------------------


def test_missing_file_directory_empty_not_yaml_not_a_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "cannot read scenario" in refused(tmp_path / "nope.yaml", tmp_path, capsys)
    (tmp_path / "dir.yaml").mkdir()
    assert "cannot read scenario" in refused(tmp_path / "dir.yaml", tmp_path, capsys)
    for text, why in (("", "top level must be a mapping"), ("a: [1, 2", "not valid YAML"), ("- 1\n", "top level must be a mapping"),
                      ("!!python/object/apply:os.system ['true']\n", "not valid YAML"), ("? [1, 2]\n: x\n", "not valid YAML")):
        p = tmp_path / "raw.yaml"
        p.write_text(text)
        err = refused(p, tmp_path, capsys)
        assert str(p) in err and why in err, (text, err)


def test_scenario_that_is_not_utf8_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "bin.yaml"
    p.write_bytes(b"name: \xff\xfe\x00\n")
    assert "not UTF-8" in refused(p, tmp_path, capsys)  # was: UnicodeDecodeError traceback


def test_duplicate_key_is_refused_not_silently_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = scenario(tmp_path)
    p.write_text(p.read_text() + "cache:\n  edge_cache_gb: 1\n")  # a second 'cache' wins silently in plain YAML
    err = refused(p, tmp_path, capsys)
    assert "duplicate key 'cache'" in err


def test_anchors_and_merge_keys_still_work(tmp_path: Path, ctx: dict[str, Any]) -> None:
    p = tmp_path / "merge.yaml"
    p.write_text(
        "name: probe\nmodel: qwen2.5-7b\ngpu: a100-80gb\n"
        "topology:\n  origins: [{city: Frankfurt am Main}]\n  regions:\n"
        "    - &uk {name: uk, city: 'London, GB', uplink_gbps: 10}\n"
        "    - {<<: *uk, name: us, city: New York City}\n"  # a merged key overridden is not a duplicate
        "workload: {kind: synthetic, requests: 50, duration_s: 100}\n"
    )
    sc = load_scenario(p, **ctx)
    assert [(r.name, r.uplink_gbps) for r in sc.topology.regions] == [("uk", 10.0), ("us", 10.0)]


def test_deep_nesting_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "deep.yaml"
    p.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    err = refused(p, tmp_path, capsys)
    assert str(p) in err


BAD_FIELDS = [
    ("seed", lambda d: d.update(seed=-1), "seed: Input should be greater than or equal to 0"),
    ("duration_inf", lambda d: d["workload"].update(duration_s=float("inf")), "workload.duration_s: Input should be a finite number"),
    ("uplink_inf", lambda d: d["topology"]["regions"][0].update(uplink_gbps=float("inf")), "topology.regions[0].uplink_gbps: Input should be a finite"),
    ("uplink_neg", lambda d: d["topology"]["regions"][0].update(uplink_gbps=-1), "topology.regions[0].uplink_gbps"),
    ("access_neg", lambda d: d["topology"].update(access_latency_ms=-5), "topology.access_latency_ms"),
    ("cache_inf", lambda d: d["cache"].update(edge_cache_gb=float("inf")), "cache.edge_cache_gb: Input should be a finite number"),
    ("cache_nan", lambda d: d["cache"].update(edge_cache_gb=float("nan")), "cache.edge_cache_gb"),
    ("turns_inf", lambda d: d["workload"].update(session_turns_mean=float("inf")), "workload.session_turns_mean"),
    ("price_inf", lambda d: d.update(prices={"wan_per_gb": float("inf")}), "prices.wan_per_gb"),
    ("edges_zero", lambda d: d["topology"]["regions"][0].update(edges=0), "topology.regions[0].edges"),
    ("dup_region", lambda d: d["topology"]["regions"].append({"name": "uk", "city": "Paris"}), "region names must be unique"),
    ("unknown_city", lambda d: d["topology"]["regions"][0].update(city="Atlantis City"), "topology.regions[0].city: unknown city"),
    ("unknown_key", lambda d: d.update(colour="blue"), "colour: unknown key"),
    ("wrong_type", lambda d: d["topology"].update(regions={"uk": 1}), "topology.regions: Input should be a valid list"),
    ("sweep_neg", lambda d: d.update(report={"cache_sweep_gb": [-5]}), "report.cache_sweep_gb: cache sizes must be >= 0"),
    ("sweep_nan", lambda d: d.update(report={"cache_sweep_gb": [float("nan")]}), "report.cache_sweep_gb[0]"),
    ("tune_replicas_0", lambda d: d.update(tune={"replicas": [0]}), "tune.replicas: values must be >= 1"),
    ("tune_policies_empty", lambda d: d.update(tune={"policies": []}), "tune.policies: List should have at least 1 item"),
    ("tune_sizes_empty", lambda d: d.update(tune={"edge_cache_gb": []}), "tune.edge_cache_gb: List should have at least 1 item"),
    ("tune_sizes_nan", lambda d: d.update(tune={"edge_cache_gb": [float("nan")]}), "tune.edge_cache_gb[0]"),
]

# Before the fix these allocated without bound (MemoryError, or the OOM killer): run in a child.
HUGE_FIELDS = [
    ("block_huge", lambda d: d.update(block_tokens=10**30), "block_tokens: Input should be less than or equal"),
    ("doc_tokens_huge", lambda d: d["workload"].update(doc_tokens_median=10**15, doc_tokens_max=10**15), "workload.doc_tokens_median"),
    ("documents_huge", lambda d: d["workload"].update(documents=1 << 30), "workload.documents"),
    ("gpu_replicas_huge", lambda d: d.update(gpu_replicas_per_edge=10**12), "gpu_replicas_per_edge"),
    ("edges_total", lambda d: [r.update(edges=4000) for r in d["topology"]["regions"]], "topology: 8,000 edges in all"),
    ("turns_huge", lambda d: d["workload"].update(session_turns_mean=1e30), "workload.session_turns_mean"),
    ("requests_huge", lambda d: d["workload"].update(requests=10**12), "workload.requests"),
]

@pytest.mark.parametrize(("mutate", "field"), [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_bad_field_is_named_before_simulating(mutate: Any, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = scenario(tmp_path, mutate)
    err = refused(p, tmp_path, capsys)
    assert str(p) in err and field in err, err


@pytest.mark.parametrize(("mutate", "field"), [c[1:] for c in HUGE_FIELDS], ids=[c[0] for c in HUGE_FIELDS])
def test_enormous_count_is_named_without_allocating(mutate: Any, field: str, tmp_path: Path) -> None:
    p = scenario(tmp_path, mutate)
    r = run_child(p, tmp_path, timeout_s=60, mem_bytes=2 << 30)
    assert r.returncode == 2 and str(p) in r.stderr and field in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_synthetic_chunks_past_the_key_layout_are_refused_not_aliased(tmp_path: Path) -> None:
    """A request's tail chunk j is TAIL_BASE + owner * 4096 + j: past 4096 chunks, request k's
    chunks were request k+1's keys, so unrelated requests "hit" each other's KV."""

    def tiny_blocks(d: dict[str, Any]) -> None:
        d["block_tokens"] = 1
        d["workload"].update(documents=1, doc_tokens_median=1, doc_tokens_max=1, query_tokens=5000, session_fraction=0.0)

    with pytest.raises(ConfigError, match=r"workload: a request spans 5,001 chunks of block_tokens=1.*at most 4,096"):
        prepare(scenario(tmp_path, tiny_blocks))


def test_auto_edges_more_than_the_known_cities(tmp_path: Path, ctx: dict[str, Any]) -> None:
    def auto(d: dict[str, Any]) -> None:
        d["topology"].pop("regions")
        d["topology"]["auto_edges"] = {"count": 5000}

    real = ctx["cities"]

    class Few:
        def find(self, name: str) -> Any:
            return real.find(name)

        def largest(self, n: int) -> list[Any]:
            return real.largest(min(n, 10))

    with pytest.raises(ConfigError, match=r"auto_edges.count: 5,000 edges asked, only 10 cities known"):
        load_scenario(scenario(tmp_path, auto), cities=Few(), presets=ctx["presets"])  # type: ignore[arg-type]


def test_infinite_duration_does_not_hang(tmp_path: Path) -> None:
    """duration_s: .inf used to spin forever in the arrival sampler."""
    p = scenario(tmp_path, lambda d: d["workload"].update(duration_s=float("inf")))
    r = run_child(p, tmp_path, timeout_s=60)
    assert r.returncode == 2 and "workload.duration_s" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_enormous_auto_edges_is_refused_quickly(tmp_path: Path) -> None:
    """auto_edges.count: 10**9 used to build a 34,000 x 34,000 latency table (tens of GB)."""

    def auto(d: dict[str, Any]) -> None:
        d["topology"].pop("regions")
        d["topology"]["auto_edges"] = {"count": 10**9}

    r = run_child(scenario(tmp_path, auto), tmp_path, timeout_s=60)
    assert r.returncode == 2 and "topology.auto_edges.count" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_workload_larger_than_memory_is_one_error(tmp_path: Path) -> None:
    """A request count whose arrays do not fit: a ConfigError naming the scenario, not MemoryError."""
    p = scenario(tmp_path, lambda d: d["workload"].update(requests=500_000_000))
    r = run_child(p, tmp_path, timeout_s=60, mem_bytes=2 << 30)
    assert r.returncode == 2 and "do not fit in memory" in r.stderr and str(p) in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_yaml_alias_bomb_stays_small(tmp_path: Path) -> None:
    """A billion-laughs document (10**9 leaves through aliases) is refused without expanding it."""
    levels = "".join(
        f"  l{i}: &l{i} [" + ",".join(["y"] * 10 if i == 0 else [f"*l{i - 1}"] * 10) + "]\n" for i in range(8)
    )
    p = scenario(tmp_path)
    p.write_text(p.read_text() + "bomb:\n" + levels + "tune:\n  replicas: [" + ",".join(["*l7"] * 10) + "]\n")
    r = run_child(p, tmp_path, timeout_s=60, mem_bytes=2 << 30)
    assert r.returncode == 2 and "bomb: unknown key" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


# -- CLI options -------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "why"), [
    (("--requests", "-1"), "--requests must be >= 1"),
    (("--requests", "0"), "--requests must be >= 1"),
    (("--policy", "teleport"), "--policy: unknown policy 'teleport'"),
])
def test_bad_cli_options(extra: tuple[str, ...], why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert why in refused(scenario(tmp_path), tmp_path, capsys, *extra)


def test_bad_option_json_is_one_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["simulate", str(scenario(tmp_path)), "--json", "--requests", "-3", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 2 and "--requests" in json.dumps(doc)


# -- trace files -------------------------------------------------------------------------------


def trace_scenario(tmp_path: Path, body: bytes, name: str = "t.jsonl") -> tuple[Path, Path]:
    t = tmp_path / name
    t.write_bytes(body)
    return scenario(tmp_path, lambda d: d.update(workload={"kind": "trace", "path": str(t)})), t


BAD_TRACES = [
    ("empty", b"", "holds no requests"),
    ("blank_lines", b"\n  \n", "holds no requests"),
    ("truncated", GOOD_TRACE.encode() + b'{"timestamp": 20, "input_le', "(line 3): Unterminated string"),
    ("missing_column", GOOD_TRACE.encode() + b'{"timestamp": 20, "hash_ids": [1]}\n', "(line 3): missing field 'input_length'"),
    ("non_numeric", GOOD_TRACE.encode() + b'{"timestamp": "abc", "input_length": 1, "hash_ids": []}\n', "(line 3): timestamp: expected a number"),
    ("not_an_object", GOOD_TRACE.encode() + b"[1, 2]\n", "(line 3): expected a JSON object, got list"),
    ("negative_length", GOOD_TRACE.encode() + b'{"timestamp": 20, "input_length": -1024, "hash_ids": [5, 6]}\n', "(line 3): input_length: out of range"),
    ("nan_timestamp", GOOD_TRACE.encode() + b'{"timestamp": NaN, "input_length": 600, "hash_ids": [0, 1]}\n', "(line 3): timestamp: out of range, got nan"),
    ("inf_timestamp", GOOD_TRACE.encode() + b'{"timestamp": Infinity, "input_length": 600, "hash_ids": [0, 1]}\n', "(line 3): timestamp: out of range"),
    ("huge_length", GOOD_TRACE.encode() + b'{"timestamp": 20, "input_length": 1e300, "hash_ids": [0]}\n', "(line 3): input_length: expected an integer"),
    ("huge_hash_id", GOOD_TRACE.encode() + b'{"timestamp": 20, "input_length": 9, "hash_ids": [99999999999999999999999]}\n', "(line 3): hash_ids: expected a list of 64-bit"),
    ("float_hash_id", GOOD_TRACE.encode() + b'{"timestamp": 20, "input_length": 1100, "hash_ids": [0, 1.5, 2]}\n', "(line 3): hash_ids"),
    ("line_after_blanks", GOOD_TRACE.encode() + b"\n\n\n{bad\n", "(line 6):"),
    ("binary", b"\xff\xfe\x00garbage", "(line 1):"),
    ("corrupt_gzip", gzip.compress(GOOD_TRACE.encode())[:15] + b"\x00" * 10, "cannot read trace"),
    ("truncated_gzip", gzip.compress(GOOD_TRACE.encode() * 50)[:40], "cannot read trace"),
]


@pytest.mark.parametrize(("body", "why"), [c[1:] for c in BAD_TRACES], ids=[c[0] for c in BAD_TRACES])
def test_bad_trace_is_one_error_naming_file_and_line(body: bytes, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p, t = trace_scenario(tmp_path, body)
    err = refused(p, tmp_path, capsys)
    assert "workload.path: " in err and str(t) in err and why in err, err


def test_trace_path_that_is_a_directory_or_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for target in (tmp_path, tmp_path / "missing.jsonl"):
        p = scenario(tmp_path, lambda d, t=target: d.update(workload={"kind": "trace", "path": str(t)}))
        assert "workload.path: trace file not found" in refused(p, tmp_path, capsys)


def test_gzip_trace_and_out_of_order_timestamps_replay(tmp_path: Path) -> None:
    rows = GOOD_TRACE + '{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [0, 7]}\n'
    p, _ = trace_scenario(tmp_path, gzip.compress(rows.encode()), "t.jsonl.gz")
    reqs = prepare(p).requests
    assert len(reqs) == 3 and list(reqs.t) == [0.0, 0.005, 0.010]  # sorted by arrival


def test_shipped_production_trace_reads_in_full() -> None:
    reqs = prepare(REPO_ROOT / "kdn" / "simulator" / "scenarios" / "mooncake.yaml").requests
    assert len(reqs) == 12_031 and reqs.t[0] == 0.0 and (reqs.t[1:] >= reqs.t[:-1]).all()


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".hidden", "", "a" * 200])
def test_a_scenario_name_names_a_folder_inside_out_not_a_path(name: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    # the name is the default plot folder out/<name>: "../../x" would write outside out/
    err = refused(scenario(tmp_path, lambda d: d.update(name=name)), tmp_path, capsys)
    assert "name" in err
