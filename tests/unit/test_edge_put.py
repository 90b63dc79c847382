"""Put at the edge under bad input and floods: refused at the first bad bytes, bounded in memory."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc

from kdn.edge.compose import compose_edge
from kdn.edge.server import EdgeServicer, PutBudget
from kdn.testing import Aborted, FakeServicerContext, InMemoryOverlay, make_chain, origin_with
from kdn.keys import Namespace
from kdn.proto import kdn_pb2 as pb
from kdn.wire.auth import TokenAuth
from kdn.wire.convert import put_messages


def _servicer(node: Any) -> EdgeServicer:
    return EdgeServicer(compose_edge(node.config, address=node.address, auth=TokenAuth(), clock=node.clock, node=node,
                                     hints_dir=None, shm=False).front)


async def _put(servicer: EdgeServicer, messages: AsyncIterator[pb.PutChunk]) -> tuple[Any, str]:
    ctx = FakeServicerContext()
    try:
        await servicer.Put(messages, ctx)  # type: ignore[arg-type]
    except Aborted:
        pass
    return ctx.code, ctx.details


def _header(chain: Any, total: int) -> pb.PutHeader:
    return pb.PutHeader(key=bytes(chain.keys[0]), fingerprint=bytes(chain.fingerprint),
                        namespace=pb.Namespace(tenant="default"), total_size=total)


def test_a_junk_put_is_refused_after_its_first_message_and_the_rest_is_never_read() -> None:
    chain = make_chain(1)
    piece = 1 << 20
    pulled = 0

    async def junk(n: int) -> AsyncIterator[pb.PutChunk]:
        nonlocal pulled
        for i in range(n):
            pulled += 1
            data = b"\xff" * piece
            yield pb.PutChunk(header=_header(chain, n * piece), data=data) if i == 0 else pb.PutChunk(data=data)

    async def newer_version() -> AsyncIterator[pb.PutChunk]:
        nonlocal pulled
        blob = bytearray(chain.blobs[0])
        blob[4:6] = (99).to_bytes(2, "little")  # a version this edge does not know
        for i in range(50):
            pulled += 1
            yield pb.PutChunk(header=_header(chain, 50 * len(blob)), data=bytes(blob)) if i == 0 else pb.PutChunk(data=bytes(blob))

    async def main() -> None:
        nonlocal pulled
        async with InMemoryOverlay(1, origin=origin_with([])) as ov:
            servicer = _servicer(ov.nodes["e0"])
            code, details = await _put(servicer, junk(300))
            assert code == grpc.StatusCode.DATA_LOSS and "magic" in details
            assert pulled == 1  # refused at the first message: the other 299 MiB were never read
            assert servicer.front.put_budget.used == 0 and servicer.front.put_budget.peak == 0
            pulled = 0
            code, details = await _put(servicer, newer_version())
            assert code == grpc.StatusCode.DATA_LOSS and "version" in details and pulled == 1
            assert not ov.nodes["e0"].store.contains(chain.keys[0], tenant="default")

    asyncio.run(main())


def test_concurrent_large_puts_cannot_buffer_past_the_budget() -> None:
    chain = make_chain(8, shape=(4, 4, 64, 64))  # ~260 KiB artifacts
    size = len(chain.blobs[0])
    budget = 3 * size  # fewer than the Puts in flight at once
    gate = asyncio.Event()

    async def slow(i: int) -> AsyncIterator[pb.PutChunk]:
        msgs = list(put_messages(chain.blobs[i], key=chain.keys[i], fingerprint=chain.fingerprint,
                                 namespace=Namespace("default"), piece=size // 4))
        yield msgs[0]
        await gate.wait()  # every stream holds its first piece before any finishes
        for m in msgs[1:]:
            yield m

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin_with([]), put_buffer_bytes=budget) as ov:
            servicer = _servicer(ov.nodes["e0"])
            tasks = [asyncio.ensure_future(_put(servicer, slow(i))) for i in range(8)]
            await asyncio.sleep(0)
            for _ in range(20):
                await asyncio.sleep(0)
            gate.set()
            results = await asyncio.gather(*tasks)
            assert servicer.front.put_budget.peak <= budget
            assert servicer.front.put_budget.used == 0  # every lease was given back, refused or not
            codes = [c for c, _ in results]
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes  # some were refused, with a clear status
            assert None in codes  # and some were stored
            stored = [i for i, (c, _) in enumerate(results) if c is None]
            for i in stored:
                assert ov.nodes["e0"].store.contains(chain.keys[i], tenant="default")
            # once the flood is over, a Put fits again
            code, _ = await _put(servicer, slow(7) if 7 not in stored else slow(stored[0]))
            assert code is None

    asyncio.run(main())


def _poisoned(blob: bytes) -> bytes:
    """Checksum-valid (every check recomputed) but undecodable: the first section is cut short."""
    from kdn.testing import reseal

    return reseal(blob, payloads=lambda ps: [ps[0][: len(ps[0]) // 2], *ps[1:]])


def test_a_checksum_valid_undecodable_put_does_not_shadow_the_honest_put_after_it() -> None:
    from kdn.artifact import decode_artifact, verify_artifact

    async def stream(chain: Any, blob: bytes) -> AsyncIterator[pb.PutChunk]:
        for m in put_messages(blob, key=chain.keys[0], fingerprint=chain.fingerprint, namespace=Namespace("default")):
            yield m

    async def main() -> None:
        for codec in ("raw", "zstd", "kvq"):
            chain = make_chain(1, codec=codec)
            poison = _poisoned(chain.blobs[0])
            verify_artifact(poison)  # passes every integrity check ...
            try:
                decode_artifact(poison)  # ... yet no reader can use it
                raise AssertionError("the crafted artifact decodes")
            except Exception as exc:  # noqa: BLE001 - whatever the codec raises
                assert not isinstance(exc, AssertionError)
            async with InMemoryOverlay(1, origin=origin_with([])) as ov:
                node = ov.nodes["e0"]
                servicer = _servicer(node)
                code, details = await _put(servicer, stream(chain, poison))
                assert code == grpc.StatusCode.DATA_LOSS, (codec, code, details)
                assert not node.store.contains(chain.keys[0], tenant="default")
                assert (await _put(servicer, stream(chain, chain.blobs[0])))[0] is None
                data, _ = await node.fetch_bytes(chain.spec(0, local_only=True))
                assert data == chain.blobs[0]  # the honest bytes are what is served
                # and an undecodable answer from upstream is not kept either
                other = make_chain(1, codec=codec, seed=5)
                ov.origin.artifacts[bytes(other.keys[0])] = _poisoned(other.blobs[0])
                try:
                    await node.fetch_bytes(other.spec(0))
                    raise AssertionError("served an undecodable artifact")
                except Exception as exc:  # noqa: BLE001
                    assert not isinstance(exc, AssertionError)
                assert not node.store.contains(other.keys[0], tenant="default")

    asyncio.run(main())


def test_a_refused_put_lets_go_of_its_bytes_without_waiting_for_the_garbage_collector() -> None:
    """A refused call's exception, traceback and frames form a cycle; left alone, the request's
    messages stay in memory until a full collection, and a flood of refused Puts grows the edge
    (benchmarks/put_flood.py). The envelope drops the finished frames' locals when it refuses."""
    import gc
    import tracemalloc

    chain = make_chain(1)
    big = 16 << 20

    async def junk() -> AsyncIterator[pb.PutChunk]:
        yield pb.PutChunk(header=_header(chain, 2 * big), data=b"\xff" * big)
        yield pb.PutChunk(data=b"\xff" * big)

    async def main() -> int:
        async with InMemoryOverlay(1, origin=origin_with([])) as ov:
            servicer = _servicer(ov.nodes["e0"])
            gc.collect()
            base = tracemalloc.get_traced_memory()[0]
            code, _ = await _put(servicer, junk())
            assert code == grpc.StatusCode.DATA_LOSS
            return tracemalloc.get_traced_memory()[0] - base

    gc.disable()
    tracemalloc.start()
    try:
        held = asyncio.run(main())
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < big // 2, f"{held} bytes still held after the refusal"
