"""An origin served in process for unit tests: a real ``OriginServer`` behind its real servicer
on a :class:`kdn.wire.inproc.InProcessServer` (no sockets), with the model already loaded."""

from __future__ import annotations

from pathlib import Path

from kdn.models import LoadedModel
from kdn.origin.config import OriginConfig
from kdn.origin.server import OriginServer, OriginServicer
from kdn.wire.inproc import InProcessServer
from kdn.wire.service import add_servicer


def origin_in_process(store_dir: Path, lm: LoadedModel, *, chunk_size: int,
                      tokens: dict[str, list[str]]) -> tuple[OriginServer, InProcessServer]:
    """A raw-codec origin for ``lm`` storing under ``store_dir``; the caller closes the server."""
    cfg = OriginConfig(store_dir=str(store_dir), models=[lm.spec], codecs=["raw"], chunk_size=chunk_size,
                       verify_on_start="none", fsync=False, tokens=tokens)
    srv = OriginServer(cfg, preloaded=(lm,))
    inproc = InProcessServer()
    add_servicer(inproc, OriginServicer(srv), "OriginService")
    return srv, inproc
