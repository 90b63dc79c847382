"""An inference host's line to the store that blends (:mod:`kdn.origin.blend`): ``Blend``, then the
variant's chunks by ``Fetch``, both from the origin that computed them.

A blend variant is made for one prompt and read by the request that asked (and its repeats), so
it is fetched from the origin's memory, not through an edge: an edge caching one chain per
combination of documents would evict the segments every combination shares (what makes reuse
decay). Segments themselves stay ordinary artifacts, held and served by edges like chunks.

    sb = StoreBlend(StoreBlendConfig(origin="10.0.0.9:50061", token=...))
    answer = await sb.blend(fingerprint, namespace, prompt_tokens)   # BlendAnswer: keys or a refusal
    async for piece, via in sb.fetch(fingerprint, namespace, answer.keys[0]):
        reader.feed(piece)                                            # verify as any artifact
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Sequence

from kdn.keys import ChunkKey, ModelFingerprint, Namespace
from kdn.wire.calls import fetch_method
from kdn.wire.channel import aio_channel, auth_metadata
from kdn.wire.convert import fetch_request
from kdn.wire.errors import rpc_errors
from kdn.wire.frames import decode_chunk
from kdn.wire.origin import BlendAnswer, OriginCalls
from kdn.wire.tls import TlsFiles

__all__ = ["BlendAnswer", "StoreBlend"]


class StoreBlend:
    """One origin, one channel (made on the event loop that uses it), deadlines on every call."""

    def __init__(self, address: str, *, token: str | None = None, tls: TlsFiles | None = None,
                 blend_timeout_s: float = 300.0, fetch_timeout_s: float = 30.0) -> None:
        self.address = address
        self._token = token
        self._blend_timeout = blend_timeout_s
        self._fetch_timeout = fetch_timeout_s
        self._channel = aio_channel(address, tls=tls)
        self._peer = f"origin {address}"
        self._calls = OriginCalls(self._channel, self._peer, token=token)
        self._fetch = fetch_method(self._channel, "OriginService")

    async def blend(self, fingerprint: ModelFingerprint, namespace: Namespace, tokens: Sequence[int],
                    documents: Sequence[tuple[int, int]] = ()) -> BlendAnswer:
        return await self._calls.blend(fingerprint, namespace, tokens, documents, timeout=self._blend_timeout)

    async def fetch(self, fingerprint: ModelFingerprint, namespace: Namespace, key: ChunkKey,
                    timeout: float | None = None) -> AsyncIterator[tuple[Any, str]]:
        """``(piece, "origin")`` of one lossless artifact, as it streams (verify with an
        :class:`~kdn.artifact.ArtifactReader`)."""
        req = fetch_request(key, fingerprint=fingerprint, namespace=namespace, require_lossless=True)
        with rpc_errors(self._peer):
            call = self._fetch(req, timeout=timeout or self._fetch_timeout, metadata=auth_metadata(self._token))
            async for raw in call:
                yield decode_chunk(raw).data, "origin"

    async def close(self) -> None:
        await self._channel.close(grace=None)
