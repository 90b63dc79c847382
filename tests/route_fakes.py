"""Fake inference hosts for the router's tests: the HTTP surface of ``vllm serve`` (``/health``,
``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``, streamed or not) over a real KDN
client talking to a real edge, with a prefill that costs ``s_per_token`` seconds per computed
token, one prefill at a time (an engine's compute is the bottleneck).

A request is tokenized with the router's tokenizer, its prefix KV is reused through
:meth:`kdn.client.AsyncKdnClient.reuse` (so peer edges and the origin are asked exactly as a
vLLM host's connector asks them), the rest "computed" (KV made from the token ids, deterministic)
and written back. :attr:`FakeHost.counters` tells what each host reused and computed.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import torch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kdn.client import AsyncKdnClient, ClientConfig
from kdn.transport import EdgeTransport
from kdn.keys import ModelFingerprint
from kdn.kv import KVShape
from kdn.prompts import ByteTokenizer, Tokenizer, chat_tokens

class ChatByteTokenizer(ByteTokenizer):
    """:class:`ByteTokenizer` with a ChatML template (what the trained built-in model uses)."""

    def render_chat(self, messages: Any, *, add_generation_prompt: bool) -> str:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float16)
FP = ModelFingerprint(bytes(range(32)))


def fake_kv(tokens: list[int], shape: KVShape = SHAPE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(1, H, N, D)`` keys and values made from the token ids (same on every host)."""
    t = torch.tensor(tokens, dtype=torch.float32)  # (N,)
    base = (t[None, None, :, None] + torch.arange(shape.head_dim)[None, None, None, :]) / 300.0  # (1, 1, N, D)
    out = []
    for layer in range(shape.num_layers):
        k = (base + layer).expand(1, shape.num_kv_heads, len(tokens), shape.head_dim).to(shape.dtype).contiguous()
        out.append((k, (-k).contiguous()))
    return out


class FakeHost:
    def __init__(self, name: str, tok: Tokenizer, transport: EdgeTransport | None, *, s_per_token: float,
                 chunk_size: int, owned_by: str = "vllm", fingerprint: ModelFingerprint = FP,
                 shape: KVShape = SHAPE, s_per_byte_loaded: float = 0.0) -> None:
        self.name = name
        self.s_per_byte_loaded = s_per_byte_loaded  # the engine's cost of taking in loaded KV
        self.shape = shape
        self.fingerprint = fingerprint
        self.tok = tok
        self.s_per_token = s_per_token
        self.chunk_size = chunk_size
        self.owned_by = owned_by
        self.client = AsyncKdnClient(ClientConfig(edge=None, write_back=True), transport=transport)
        self.engine = asyncio.Lock()
        self.down = False
        self.counters: dict[str, float] = {"requests": 0, "computed_tokens": 0, "reused_tokens": 0,
                                           "reused_chunks": 0, "reused_pieces": 0, "fetched_bytes": 0}
        self.bodies: list[dict[str, Any]] = []
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
        ])

    async def health(self, request: Request) -> Response:
        if self.down:
            return Response(status_code=503)
        return Response(status_code=200)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": self.owned_by}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"]
        tokens = list(prompt) if isinstance(prompt, list) else self.tok.encode_prompt(prompt)
        return await self._serve(body, tokens, "text_completion")

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        return await self._serve(body, chat_tokens(self.tok, body["messages"]), "chat.completion")

    async def prefill(self, tokens: list[int], use_kdn: bool) -> int:
        """Reuse what the edge has, compute the rest (one prefill at a time); tokens computed."""
        async with self.engine:
            reused = 0
            if use_kdn and self.client.transport is not None:
                r = await self.client.reuse(tokens, fingerprint=self.fingerprint, kv_shape=self.shape, chunk_size=self.chunk_size,
                                            max_tokens=len(tokens) - 1)
                reused = r.tokens
                self.counters["reused_chunks"] += r.chunks
                self.counters["reused_pieces"] += r.pieces
                self.counters["fetched_bytes"] += r.bytes
                computed = len(tokens) - reused
                await asyncio.sleep(computed * self.s_per_token + r.bytes * self.s_per_byte_loaded)
                self.client.schedule_write_back(fake_kv(tokens, self.shape), r.keys, fingerprint=self.fingerprint, chunk_size=self.chunk_size,
                                                start=r.chunks, tokens=tokens, piece_start=r.pieces)
            else:
                computed = len(tokens)
                await asyncio.sleep(computed * self.s_per_token)
            self.counters["reused_tokens"] += reused
            self.counters["computed_tokens"] += computed
            return computed

    async def _serve(self, body: dict[str, Any], tokens: list[int], kind: str) -> Response:
        self.counters["requests"] += 1
        self.bodies.append(body)
        params = body.get("kv_transfer_params") or {}
        await self.prefill(tokens, params.get("kdn") is not False)
        text = "ok"
        if body.get("stream"):
            async def events() -> Any:
                key = "text" if kind == "text_completion" else "delta"
                piece = {"text": text} if key == "text" else {"delta": {"content": text}}
                yield f"data: {json.dumps({'object': kind, 'host': self.name, 'choices': [piece]})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        choice = {"text": text} if kind == "text_completion" else {"message": {"role": "assistant", "content": text}}
        return JSONResponse({"object": kind, "host": self.name, "created": int(time.time()), "choices": [choice],
                             "usage": {"prompt_tokens": len(tokens)}})

    async def close(self) -> None:
        await self.client.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.route_fakes --edge ADDR --model DIR [--s-per-token S] [--chunk-size C]``:
    one fake host on a free loopback port; prints ``{"event": "ready", "url": ...}``."""
    import argparse
    import socket

    import uvicorn

    from transformers import AutoConfig

    from kdn.transport import GrpcEdgeTransport
    from kdn.route.model import load_route_model

    p = argparse.ArgumentParser()
    p.add_argument("--edge")
    p.add_argument("--model", required=True)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--s-per-token", type=float, default=0.002)
    p.add_argument("--owned-by", default="vllm")
    args = p.parse_args(argv)
    model = load_route_model(args.model, dtype="float32", chunk_size=args.chunk_size)

    async def serve() -> None:
        transport = GrpcEdgeTransport(args.edge, bulk=False) if args.edge else None
        host = FakeHost("fake", model.tokenizer, transport, s_per_token=args.s_per_token, chunk_size=args.chunk_size,
                        owned_by=args.owned_by, fingerprint=model.fingerprint,  # the router's keys
                        shape=KVShape.from_config(AutoConfig.from_pretrained(model.directory), torch.float32))
        host.app.add_route("/fake/counters", lambda r: JSONResponse(host.counters), methods=["GET"])
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        server = uvicorn.Server(uvicorn.Config(host.app, log_level="warning", lifespan="off"))
        print(json.dumps({"event": "ready", "url": f"http://127.0.0.1:{sock.getsockname()[1]}"}), flush=True)
        await server.serve(sockets=[sock])
        await host.close()

    asyncio.run(serve())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
