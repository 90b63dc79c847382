"""Where ``kdn ingest`` prefills: in this process, on a Ray cluster it joins, or on a Ray it starts.

After ``kdn up`` a user exports ``RAY_ADDRESS`` (and Ray's auth variables) and expects ingest to
run on the cluster's origin nodes, as the README's diagram shows; with nothing exported, the
in-process path needs no Ray at all. :func:`decide` is that choice, as data, so it is tested
without Ray; the CLI prints :attr:`Placement.describe` so the user always sees which it took.

The rules, first match wins:

1. ``--local``: in this process (``--local`` with ``--workers N > 0`` is a contradiction: refused);
2. ``--workers 0``: in this process;
3. ``--workers N``: N Ray workers, on the cluster at ``--ray-address``/``RAY_ADDRESS`` if one is
   named, else on a new local Ray;
4. a cluster named (``--ray-address``, the config's ``ray_address``, or ``RAY_ADDRESS``): Ray
   workers there, one per ``kdn_origin`` node (counted once joined; none: back to this process,
   said in one line);
5. otherwise: in this process.

On a cluster the ``kdn_origin`` unit of each origin node is held by its origin server (``kdn up``),
so ingest workers are pinned to those nodes (:func:`origin_nodes`) and ask only for CPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Mapping

from kdn.errors import InvalidInput

__all__ = ["Placement", "decide", "origin_nodes"]

Mode = Literal["local", "cluster", "new-ray"]


@dataclass(frozen=True, slots=True)
class Placement:
    """``workers``: 0 in this process; None: one per ``kdn_origin`` node of the cluster joined."""

    mode: Mode
    workers: int | None
    address: str | None
    reason: str

    def describe(self, workers: int | None = None) -> str:
        n = self.workers if workers is None else workers
        if self.mode == "local":
            return f"in this process, no Ray ({self.reason})"
        if self.mode == "new-ray":
            return f"on {n} Ray worker(s) of a new local Ray ({self.reason})"
        count = f"{n} Ray worker(s)" if n is not None else "one Ray worker per kdn_origin node"
        return f"on {count} of the cluster at {self.address} ({self.reason}; --local to stay in this process)"


def decide(*, workers: int | None, local: bool, ray_address: str | None, env: Mapping[str, str]) -> Placement:
    """Apply the module's rules. ``workers``/``ray_address``: as given by flags or config file
    (None: not given); ``env``: the environment (``RAY_ADDRESS``)."""
    if local:
        if workers:
            raise InvalidInput(f"--local and --workers {workers} contradict each other: give one")
        return Placement("local", 0, None, "--local")
    env_address = (env.get("RAY_ADDRESS") or "").strip() or None
    address = ray_address or env_address
    named_by = "--ray-address" if ray_address else "RAY_ADDRESS"
    if workers == 0:
        return Placement("local", 0, None, "--workers 0")
    if workers:
        if address:
            return Placement("cluster", workers, address, f"--workers {workers}, {named_by}")
        return Placement("new-ray", workers, None, f"--workers {workers} and no RAY_ADDRESS")
    if address:
        return Placement("cluster", None, address, f"{named_by} is set")
    return Placement("local", 0, None, "no RAY_ADDRESS; after `kdn up`, export what it prints to use the cluster")


def origin_nodes() -> list[str]:
    """Ray node ids of the live nodes that carry ``kdn_origin`` (Ray must be initialised)."""
    import ray

    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("kdn_origin", 0) > 0)
