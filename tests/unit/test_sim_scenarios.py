"""Scenario validation (bad input -> one clear error naming the field, before any simulation),
the shipped scenarios, and the CLI (`kdn simulate` / `kdn tune` entry points)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdn.errors import ConfigError
from kdn.simulator import cli
from kdn.simulator.geo import CityIndex
from kdn.simulator.presets import load_presets
from kdn.simulator.scenario import REPO_ROOT, load_scenario

SCENARIOS = sorted((REPO_ROOT / "kdn" / "simulator" / "scenarios").glob("*.yaml"))
TRACE = REPO_ROOT / "kdn" / "simulator" / "scenarios" / "traces" / "mooncake_conversation_trace.jsonl"

TINY: dict[str, Any] = {
    "name": "tiny",
    "seed": 1,
    "model": "qwen2.5-7b",
    "gpu": "a100-80gb",
    "topology": {
        "origins": [{"city": "Frankfurt am Main", "uplink_gbps": 40}],
        "regions": [
            {"name": "uk", "city": "London, GB", "edges": 2, "group": "eu"},
            {"name": "fr", "city": "Paris", "edges": 1, "group": "eu"},
            {"name": "us", "city": "New York City", "edges": 1},
        ],
    },
    "workload": {"kind": "synthetic", "requests": 1000, "duration_s": 1800, "documents": 200, "hint_coverage": 0.2},
    "cache": {"edge_cache_gb": 16},
    "report": {"cache_sweep_gb": [4, 32]},
    "tune": {
        "policies": ["nearest_edge", "consistent_hash"],
        "replicas": [1, 2],
        "edge_cache_gb": [4, 32],
        "regional_codec": ["raw"],
        "long_haul_codec": ["zstd", "kvq4"],
        "prefetch_depth": [0],
        "max_configs": 6,
    },
}


@pytest.fixture(scope="module")
def ctx() -> dict[str, Any]:
    return {"cities": CityIndex.default(), "presets": load_presets()}


def write(tmp_path: Path, data: dict[str, Any], name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, allow_unicode=True))
    return p


def bad(tmp_path: Path, ctx: dict[str, Any], mutate: Any) -> str:
    data = copy.deepcopy(TINY)
    mutate(data)
    with pytest.raises(ConfigError) as info:
        load_scenario(write(tmp_path, data), **ctx)
    return str(info.value)


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_shipped_scenarios_validate(path: Path, ctx: dict[str, Any]) -> None:
    sc = load_scenario(path, **ctx)
    assert sc.policies


def test_mooncake_trace_ships_in_the_repo_next_to_its_scenario(ctx: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = REPO_ROOT / "kdn" / "simulator" / "scenarios" / "mooncake.yaml"
    assert yaml.safe_load(src.read_text())["workload"]["path"] == "traces/mooncake_conversation_trace.jsonl"
    assert "Apache" in (TRACE.parent / "README.md").read_text()
    monkeypatch.chdir(tmp_path)  # resolved against the scenario file, not the working directory
    sc = load_scenario(src, **ctx)
    assert Path(sc.workload.path) == TRACE.resolve()
    assert sum(1 for _ in TRACE.open()) == 12_031


def test_shipped_scenarios_cover_the_issue() -> None:
    names = {p.stem for p in SCENARIOS}
    assert {"global10", "mooncake", "scale1000"} <= names
    g = yaml.safe_load((REPO_ROOT / "kdn/simulator/scenarios/global10.yaml").read_text())
    assert len(g["topology"]["regions"]) >= 10
    s = yaml.safe_load((REPO_ROOT / "kdn/simulator/scenarios/scale1000.yaml").read_text())
    assert s["topology"]["auto_edges"]["count"] == 1000 and s["workload"]["requests"] == 1_000_000


def test_unknown_key_names_the_field(tmp_path: Path, ctx: dict[str, Any]) -> None:
    msg = bad(tmp_path, ctx, lambda d: d["topology"]["regions"][1].update(bandwith_gbps=5))
    assert "topology.regions[1].bandwith_gbps: unknown key" in msg
    msg = bad(tmp_path, ctx, lambda d: d.update(polices=["nearest_edge"]))
    assert "polices: unknown key" in msg


def test_negative_bandwidth_names_the_field(tmp_path: Path, ctx: dict[str, Any]) -> None:
    msg = bad(tmp_path, ctx, lambda d: d["topology"]["origins"][0].update(uplink_gbps=-10))
    assert "topology.origins[0].uplink_gbps" in msg and "-10" in msg and "greater than 0" in msg


def test_unknown_city_names_the_field(tmp_path: Path, ctx: dict[str, Any]) -> None:
    msg = bad(tmp_path, ctx, lambda d: d["topology"]["regions"][2].update(city="Nowhereville Prime"))
    assert "topology.regions[2].city: unknown city 'Nowhereville Prime'" in msg


def test_missing_trace_file_names_the_field(tmp_path: Path, ctx: dict[str, Any]) -> None:
    msg = bad(tmp_path, ctx, lambda d: d.update(workload={"kind": "trace", "path": "../shared/traces/nope.jsonl"}))
    assert msg.count("workload.path: trace file not found: '../shared/traces/nope.jsonl'") == 1


def test_other_bad_values(tmp_path: Path, ctx: dict[str, Any]) -> None:
    assert "model: unknown model 'gpt-9'" in bad(tmp_path, ctx, lambda d: d.update(model="gpt-9"))
    assert "unknown codec 'brotli'" in bad(tmp_path, ctx, lambda d: d.update(codecs={"long_haul": "brotli"}))
    assert "policies: unknown policy 'teleport'" in bad(tmp_path, ctx, lambda d: d.update(policies=["teleport"]))
    assert "cache.eviction: unknown eviction policy 'mru'" in bad(tmp_path, ctx, lambda d: d["cache"].update(eviction="mru"))
    assert "exactly one of 'regions'" in bad(tmp_path, ctx, lambda d: d["topology"].update(regions=[]))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_scenario(_raw(tmp_path, "a: [1, 2"), **ctx)
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_scenario(_raw(tmp_path, "- 1\n- 2\n"), **ctx)


def _raw(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "raw.yaml"
    p.write_text(text)
    return p


def test_trace_path_resolves_against_the_scenario_folder(tmp_path: Path, ctx: dict[str, Any]) -> None:
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "t.jsonl").write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n')
    data = copy.deepcopy(TINY)
    data["workload"] = {"kind": "trace", "path": "traces/t.jsonl"}
    sc = load_scenario(write(tmp_path, data), **ctx)
    assert Path(sc.workload.path) == (tmp_path / "traces" / "t.jsonl").resolve()


def test_cli_rejects_bad_scenario_before_simulating(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = copy.deepcopy(TINY)
    data["topology"]["regions"][0]["uplink_gbps"] = -1
    rc = cli.main_simulate([str(write(tmp_path, data)), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "kdn simulate: error:" in err and "topology.regions[0].uplink_gbps" in err
    assert not (tmp_path / "o").exists()


def test_cli_simulate_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = cli.main_simulate([str(write(tmp_path, TINY)), "--out", str(out), "--json", "--no-progress"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == 1000
    assert set(doc["policies"]) == {"origin_only", "nearest_edge", "consistent_hash", "popularity_push", "hint_prefetch"}
    for fig in doc["policies"].values():
        for k in ("requests", "wall_s", "events_per_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "hit_ratio", "wan_bytes"):
            assert k in fig
        assert fig["requests"] == 1000 and fig["ttft_p50_s"] <= fig["ttft_p90_s"] <= fig["ttft_p99_s"]
    for name in ("ttft_cdf", "cost_vs_p90", "hit_vs_cache"):
        png = Path(doc["plots"][name])
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main_simulate([str(write(tmp_path, TINY)), "--out", str(tmp_path / "o"), "--no-progress", "--no-sweep", "--policy", "nearest_edge"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "nearest_edge" in text and "TTFT p50 s" in text and "origin_only" not in text


def test_cli_tune_prints_pareto_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main_tune([str(write(tmp_path, TINY)), "--out", str(tmp_path / "o"), "--json", "--no-progress"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["evaluated"] == 6 and doc["grid_size"] == 2 * 2 * 2 + 2 * 2  # CH: R x size x codec; NE: size x codec
    front = doc["front"]
    costs = [p["cost_usd"] for p in front]
    p90s = [p["ttft_p90_s"] for p in front]
    assert costs == sorted(costs) and p90s == sorted(p90s, reverse=True) and len(set(p90s)) == len(p90s)
    assert doc["recommended"] in front
    assert Path(doc["plot"]).is_file()
    rc = cli.main_tune([str(write(tmp_path, TINY)), "--out", str(tmp_path / "o"), "--no-progress", "--p90-target", "1000"])
    text = capsys.readouterr().out
    assert rc == 0 and "Pareto front" in text and "recommended: cheapest with p90 TTFT <= 1000 s\n" in text
    rec = text.split("recommended: ", 1)[1]
    assert "((" not in rec.replace(" ", "") and "))" not in rec.replace(" ", "")  # issue 17 item 15: no nesting
    policy = rec.split("policies: [", 1)[1].split("]", 1)[0]
    assert ("prefetch_depth" in rec) == (policy == "hint_prefetch")  # only the knobs the policy reads
    assert ("replicas" in rec) == (policy == "consistent_hash")


def test_pareto_front_and_recommendation() -> None:
    from kdn.simulator.tuner import TuneConfig, TunePoint, _recommend, pareto_front

    def pt(cost: float, p90: float, gb: float) -> TunePoint:
        cfg = TuneConfig("nearest_edge", 1, gb, "raw", "zstd", 0)
        return TunePoint(cfg, cost, p90, p90 / 2, 0.5, 0.0, 1.0)

    pts = [pt(10, 0.9, 1), pt(20, 0.5, 2), pt(15, 0.95, 3), pt(30, 0.5, 4), pt(40, 0.2, 5), pt(25, 0.6, 6)]
    front = pareto_front(pts)
    assert [q.config.edge_cache_gb for q in front] == [1, 2, 5]  # 3, 4, 6 are dominated
    best, rule = _recommend(front, 0.6)
    assert best.config.edge_cache_gb == 2 and "cheapest" in rule
    best, rule = _recommend(front, 0.1)
    assert best.config.edge_cache_gb == 5 and "no configuration meets" in rule
    best, _ = _recommend(front, None)
    assert best.config.edge_cache_gb == 2  # the knee


def test_cli_simulation_time_includes_the_cache_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main_simulate([str(write(tmp_path, TINY)), "--out", str(tmp_path / "o"), "--no-progress", "--policy", "nearest_edge"])
    assert rc == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("setup "))
    total, policies, sweep = (float(v) for v in re.search(r"simulation ([\d.]+) s \(([\d.]+) s policies \+ ([\d.]+) s cache sweep\)", line).groups())
    assert total == pytest.approx(policies + sweep, abs=0.06) and sweep > 0


def test_each_policy_keeps_one_distinct_style_in_every_plot(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from kdn.simulator import report

    styles = [(s[1], s[2]) for s in report.POLICY_STYLE.values()]
    assert len(set(styles)) == len(styles) and len({s[0] for s in report.POLICY_STYLE.values()}) == len(styles)
    seen: dict[str, tuple[str, str]] = {}
    real_savefig = plt.Figure.savefig

    def grab(fig: Any, *a: Any, **k: Any) -> None:
        for line in fig.axes[0].get_lines():
            name = line.get_label().split(" (")[0]
            if name in report.POLICY_STYLE:
                got = (matplotlib.colors.to_hex(line.get_color()), line.get_marker())
                assert seen.setdefault(name, got) == got  # the same colour and marker in every plot
        real_savefig(fig, *a, **k)

    same = [(16.0, 0.4), (64.0, 0.6)]  # identical curves: still two distinct lines
    plt.Figure.savefig = grab  # type: ignore[method-assign]
    try:
        report.plot_hit_vs_cache({"nearest_edge": same, "popularity_push": same}, tmp_path / "a.png")
        report.plot_hit_vs_cache({"popularity_push": same, "nearest_edge": same}, tmp_path / "b.png")
    finally:
        plt.Figure.savefig = real_savefig  # type: ignore[method-assign]
    assert seen["nearest_edge"] != seen["popularity_push"]
