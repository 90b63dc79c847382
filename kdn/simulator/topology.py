"""Sites on a map: origins and edge sites (each edge fronts a pool of inference GPUs), latency
between them, the link class (metro / regional / long haul) that picks a codec, and hash groups.

Site numbering: edges are ``0 .. n_edges-1``, origins ``n_edges .. n_edges+n_origins-1``; the
latency and distance tables are ``[edge][site]``. Each site has one egress link (its uplink).
Latency is the distance model (:mod:`kdn.simulator.geo`) with each site's own access latency,
except for the pairs of named sites a measured RTT table lists (one-way = RTT / 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdn.simulator.geo import City, CityIndex, latency_matrix, read_rtt_table
from kdn.simulator.scenario import Scenario, Site

__all__ = ["Topology", "build_topology", "METRO", "REGIONAL", "LONG_HAUL", "LINK_CLASSES"]

METRO, REGIONAL, LONG_HAUL = 0, 1, 2
LINK_CLASSES = ("metro", "regional", "long_haul")


@dataclass(frozen=True, slots=True)
class Topology:
    n_edges: int
    n_origins: int
    site_names: tuple[str, ...]  # "region/edge-k" or "origin-k@City"
    site_city: tuple[str, ...]
    edge_region: np.ndarray  # (n_edges,) int: index into region_names
    region_names: tuple[str, ...]
    edge_group: np.ndarray  # (n_edges,) int: consistent-hash group
    groups: tuple[tuple[int, ...], ...]  # group -> its edges
    edge_users: np.ndarray  # (n_edges,) float: share of users (sums to 1)
    edge_lon: np.ndarray  # (n_edges,) float: for the daily cycle
    uplink_Bps: np.ndarray  # (n_sites,) float bytes/s
    latency_s: np.ndarray  # (n_edges, n_sites) one-way seconds
    distance_km: np.ndarray  # (n_edges, n_sites)
    link_class: np.ndarray  # (n_edges, n_sites) int8: METRO / REGIONAL / LONG_HAUL
    nearest_origin: np.ndarray  # (n_edges,) site index of each edge's nearest origin
    local_read_Bps: float

    @property
    def n_sites(self) -> int:
        return self.n_edges + self.n_origins


def build_topology(sc: Scenario, cities: CityIndex) -> Topology:
    topo = sc.topology
    names: list[str] = []
    city_names: list[str] = []
    lat: list[float] = []
    lon: list[float] = []
    uplink: list[float] = []
    region_of: list[int] = []
    group_key: list[str] = []
    users: list[float] = []
    region_names: list[str] = []
    access: list[float] = []  # one-way access seconds per site
    table_name: list[str] = []  # the site's name in the RTT table

    def site(name: str, c: City, uplink_gbps: float, access_ms: float | None = None, label: str = "") -> None:
        names.append(name)
        city_names.append(c.name)
        lat.append(c.lat)
        lon.append(c.lon)
        uplink.append(uplink_gbps * 1e9 / 8)
        access.append((topo.access_latency_ms if access_ms is None else access_ms) / 1000.0)
        table_name.append(label)

    def where(s: Site) -> City:
        if s.lat is not None and s.lon is not None:
            return City(name=s.city or f"{s.lat:.3f},{s.lon:.3f}", country="??", continent="??", lat=s.lat, lon=s.lon, population=0)
        assert s.city is not None
        c = cities.find(s.city)
        assert c is not None  # validated
        return c

    if topo.auto_edges is not None:
        ae = topo.auto_edges
        chosen = cities.largest(ae.count)
        for k, c in enumerate(chosen):
            region_names.append(f"{c.name}, {c.country}")
            site(f"edge-{k}@{c.name}", c, ae.uplink_gbps)
            region_of.append(k)
            group_key.append(c.continent if ae.group_by == "continent" else c.country)
            users.append(float(c.population))
    else:
        for r_idx, r in enumerate(topo.regions):
            c = where(r)
            region_names.append(r.name)
            for k in range(r.edges):
                site(f"{r.name}/edge-{k}", c, r.uplink_gbps, r.access_ms, r.name)
                region_of.append(r_idx)
                group_key.append(r.group or r.name)
                users.append(r.users_weight / r.edges)
    n_edges = len(names)
    origin_labels = topo.site_names()[len(topo.regions) :]
    for k, o in enumerate(topo.origins):
        c = where(o)
        site(f"origin-{k}@{c.name}", c, o.uplink_gbps, o.access_ms, origin_labels[k])
    lat_a = np.asarray(lat)
    lon_a = np.asarray(lon)
    acc = np.asarray(access)
    latency, km = latency_matrix(
        lat_a[:n_edges],
        lon_a[:n_edges],
        lat_a,
        lon_a,
        fibre_fraction=topo.fibre_fraction,
        route_inflation=topo.route_inflation,
        access_a=acc[:n_edges],
        access_b=acc,
    )
    if topo.rtt_table is not None:
        measured = read_rtt_table(topo.rtt_table)
        for e in range(n_edges):
            for s_ in range(len(names)):
                rtt_ms = measured.get(frozenset((table_name[e], table_name[s_])))
                if rtt_ms is not None:
                    latency[e, s_] = rtt_ms / 2000.0
    cls = np.full(km.shape, LONG_HAUL, dtype=np.int8)
    cls[km <= topo.regional_km] = REGIONAL
    cls[km <= topo.metro_km] = METRO
    group_names = sorted(set(group_key))
    gidx = {g: i for i, g in enumerate(group_names)}
    edge_group = np.array([gidx[g] for g in group_key], dtype=np.int64)
    groups = tuple(tuple(int(e) for e in np.flatnonzero(edge_group == g)) for g in range(len(group_names)))
    nearest_origin = n_edges + np.argmin(latency[:, n_edges:], axis=1)
    u = np.asarray(users)
    return Topology(
        n_edges=n_edges,
        n_origins=len(topo.origins),
        site_names=tuple(names),
        site_city=tuple(city_names),
        edge_region=np.asarray(region_of, dtype=np.int64),
        region_names=tuple(region_names),
        edge_group=edge_group,
        groups=groups,
        edge_users=u / u.sum(),
        edge_lon=lon_a[:n_edges].copy(),
        uplink_Bps=np.asarray(uplink),
        latency_s=latency,
        distance_km=km,
        link_class=cls,
        nearest_origin=nearest_origin.astype(np.int64),
        local_read_Bps=topo.local_read_gbps * 1e9 / 8,
    )
