"""KDN for Hugging Face ``transformers`` causal LMs: reuse the edge's KV, prefill the rest, generate.

    from kdn.client import ClientConfig, KdnClient
    from kdn.integrations.transformers import generate, prepare

    km = prepare(model, tokenizer)                 # any local HF causal LM with a DynamicCache
    with KdnClient(ClientConfig(edge="127.0.0.1:50051", tenant="acme")) as client:
        result = generate(km, long_document + question, client=client, max_new_tokens=32)
    result.text, result.reused_tokens, result.timings.ttft_s

Works with any model whose forward accepts ``cache=`` a ``DynamicCache`` of per-layer
``(B, kv_heads, tokens, head_dim)`` keys/values (Llama-, Qwen2-, Mistral-style), batch 1, greedy.

Invariants:
- with a lossless cache (the default) the generated tokens equal those of a full recompute: the
  reused prefix is exactly the KV a prefill of those tokens produced (checksummed, fingerprinted),
  and at least the last prompt token is always computed here, so the first token's logits come
  from this process;
- the request never fails because the cache did (see :mod:`kdn.client`); what went wrong is in
  :attr:`Result.warnings` and was logged once.

Fingerprints: for a model from :func:`kdn.models.load_model` the loader's fingerprint is used; for
any other model :func:`prepare` derives one with :func:`kdn.models.model_fingerprint`, naming the
weights by the digest of their ``*.safetensors`` files when the model came from a local directory
(the same id the origin computes for that directory) and otherwise by a digest of the parameters
(then only this host's own write-backs can be reused). Pass ``weights_id=`` or ``fingerprint=`` to
override.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from kdn.client import KdnClient, Reuse
from kdn.integrations.records import KdnModel, Result, Timings, token_ids
from kdn.errors import InvalidInput
from kdn.keys import DEFAULT_CHUNK_SIZE, ModelFingerprint
from kdn.prefill import greedy_tail
from kdn.prompts import chat_tokens
from kdn.blend import prefill_in_place, predicts_in_pass
from kdn.kv import KVShape, cache_from_layers, forward, output_cache
from kdn.layered import LoadBroken, pays
from kdn.models import DTYPES, HFTokenizer, LoadedModel, Tokenizer, _weights_digest, dir_fingerprint, is_model_dir, model_fingerprint

if TYPE_CHECKING:
    from kdn.integrations.blend import BlendOptions

__all__ = ["KdnModel", "Result", "Timings", "prepare", "generate", "weights_identity"]

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def _model_dir(model: Any) -> Path | None:
    path = str(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or "")
    return Path(path) if path and is_model_dir(path) else None


def weights_identity(model: Any) -> str:
    """Name a model's weights: safetensors digest of its local directory, else a parameter digest."""
    path = _model_dir(model)
    if path is not None:
        return "sha:" + _weights_digest(path)
    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return "params:" + h.hexdigest()


def prepare(
    model: Any,
    tokenizer: Any = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    weights_id: str | None = None,
    fingerprint: ModelFingerprint | None = None,
) -> KdnModel:
    """Bundle a model (a :class:`LoadedModel` or any HF causal LM) with its KV fingerprint."""
    if isinstance(model, KdnModel):
        return model
    if isinstance(model, LoadedModel):
        if chunk_size not in (model.chunk_size, DEFAULT_CHUNK_SIZE):
            raise InvalidInput(f"model was loaded with chunk_size={model.chunk_size}, asked for {chunk_size}")
        return KdnModel(model.model, _as_tokenizer(tokenizer) or model.tokenizer, model.fingerprint,
                        model.chunk_size, model.kv_shape)
    params = next(iter(model.parameters()), None)
    dtype = params.dtype if params is not None else torch.float32
    if dtype not in _DTYPE_NAMES:
        raise InvalidInput(f"unsupported model dtype {dtype}")
    if fingerprint is None:
        path = _model_dir(model)
        if weights_id is None and path is not None:  # what the origin computes for that directory
            fingerprint = dir_fingerprint(path, dtype=_DTYPE_NAMES[dtype], chunk_size=chunk_size)
        else:
            fingerprint = model_fingerprint(model.config, weights_id=weights_id or weights_identity(model),
                                            dtype=_DTYPE_NAMES[dtype], chunk_size=chunk_size)
    return KdnModel(model, _as_tokenizer(tokenizer), fingerprint, chunk_size, KVShape.from_config(model.config, dtype))


def _as_tokenizer(tok: Any) -> Tokenizer | None:
    if tok is None or isinstance(tok, HFTokenizer):
        return tok
    if hasattr(tok, "convert_tokens_to_ids"):  # a transformers tokenizer
        return HFTokenizer(tok)
    return tok


def _token_list(prompt: str | Sequence[int] | np.ndarray | torch.Tensor, tokenizer: Tokenizer | None,
                vocab: int) -> list[int]:
    """A text prompt's tokens exactly as an engine's completion endpoint computes them (with the
    tokenizer's BOS where it adds one: what the origin stores documents under); token ids as given,
    each an integer in the model's ``vocab``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidInput("a text prompt needs a tokenizer")
        encode = getattr(tokenizer, "encode_prompt", None) or tokenizer.encode
        return list(encode(prompt))
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() == 2 and prompt.shape[0] == 1:
            prompt = prompt[0]
        if prompt.dim() != 1:
            raise InvalidInput(f"input_ids must be (N,) or (1, N), got {tuple(prompt.shape)}")
        prompt = prompt.tolist()  # floats stay floats: refused below
    return token_ids(prompt, vocab, "the prompt")


def _prefill_reused(km: KdnModel, client: KdnClient | None, reuse: Reuse,
                    tokens: list[int]) -> tuple[Any, torch.Tensor, Reuse]:
    """The rest of the prompt prefilled into ``reuse``'s room; returns the cache, the next-token
    logits and the Reuse as it settled. A layered fetch that fails under the pass (a chunk
    corrupt, refused or late) leaves its verified leading chunks: the pass runs again over those
    (the room's later positions are all rewritten), or the prompt is computed from scratch."""
    assert reuse.room is not None
    if reuse.gate is None or client is None:
        cache, logits = prefill_in_place(km.model, reuse.room, reuse.tokens, tokens)
        return cache, logits, reuse
    try:
        cache, logits = prefill_in_place(km.model, reuse.room, reuse.tokens, tokens, ready=reuse.gate.wait)
    except LoadBroken:
        reuse = client.settle(reuse)  # nothing more is written into the room once this returns
        if reuse.tokens and reuse.room is not None:
            cache, logits = prefill_in_place(km.model, reuse.room, reuse.tokens, tokens)
        else:
            ids = torch.tensor([tokens], dtype=torch.long)  # (1, T)
            out = forward(km.model, input_ids=ids, cache=cache_from_layers([], km.config), use_cache=True,
                          logits_to_keep=1)
            cache, logits = output_cache(out), out.logits[0, -1]
        return cache, logits, reuse
    except BaseException:
        reuse.gate.stop = True  # the reader places nothing more; the fetches end at their deadlines
        raise
    return cache, logits, client.settle(reuse)


def generate(
    model: Any,
    prompt: str | Sequence[int] | np.ndarray | torch.Tensor | None = None,
    *,
    messages: Sequence[dict[str, str]] | None = None,
    tokenizer: Any = None,
    client: KdnClient | None = None,
    max_new_tokens: int = 32,
    eos_token_id: int | None = None,
    write_back: bool = True,
    documents: Sequence[str | Sequence[int]] | None = None,
    prefix: str | Sequence[int] = (),
    blend: "BlendOptions | None" = None,
) -> Result:
    """Greedy generation that reuses the edge's KV for the prompt's longest cached prefix.

    ``prompt``: text (tokenized as an engine's completion endpoint does it) or token ids; or
    ``messages``: a chat (``[{"role": "system", "content": document}, {"role": "user", ...}]``),
    rendered with the model's chat template as an engine's chat endpoint does it, so a document
    ingested with ``--layout system`` is reused (:mod:`kdn.prompts`).

    ``documents``: the prompt is ``prefix + documents + prompt`` and every document is reused
    wherever it sits, as a segment re-placed and partly recomputed (:mod:`kdn.integrations.blend`),
    when the model's blend verdict allows; otherwise as an exact prefix, with a warning.

    ``client=None`` is a plain full recompute through the same code path (the baseline).
    ``model``: a :class:`KdnModel` from :func:`prepare` (do that once: naming the weights of a
    model that did not come from a local directory hashes every parameter), a
    :class:`~kdn.models.LoadedModel`, or a bare HF model (prepared on every call).
    """
    t_start = time.perf_counter()
    km = prepare(model, tokenizer)
    if messages is not None:
        if prompt is not None or documents is not None:
            raise InvalidInput("give messages, or a prompt (with documents), not both")
        if km.tokenizer is None:
            raise InvalidInput("a chat needs a tokenizer")
        prompt = chat_tokens(km.tokenizer, messages)
    if prompt is None:
        raise InvalidInput("give a prompt or messages")
    if documents is not None:
        from kdn.integrations.blend import BlendOptions, generate_with_documents

        if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
            raise InvalidInput(f"documents must be a list of texts or token-id lists, got {type(documents).__name__}")
        if blend is not None and not isinstance(blend, BlendOptions):
            raise InvalidInput(f"blend must be a BlendOptions, got {type(blend).__name__}")
        if max_new_tokens < 1:
            raise InvalidInput("max_new_tokens must be at least 1")
        eos = eos_token_id if eos_token_id is not None else getattr(km.config, "eos_token_id", None)
        return generate_with_documents(
            km, prompt if isinstance(prompt, str) else _token_list(prompt, km.tokenizer, int(km.config.vocab_size)),
            list(documents),
            prefix=prefix, client=client, max_new_tokens=max_new_tokens,
            eos_ids=set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]),
            options=blend or BlendOptions(), t_start=t_start, generate=generate,
        )
    tokens = _token_list(prompt, km.tokenizer, int(km.config.vocab_size))
    if not tokens:
        raise InvalidInput("empty prompt")
    if max_new_tokens < 1:
        raise InvalidInput("max_new_tokens must be at least 1")
    eos = eos_token_id if eos_token_id is not None else getattr(km.config, "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])

    t0 = time.perf_counter()
    if client is not None:
        # at least the last prompt token is computed here: its logits choose the first new token
        # room for the whole prompt and the tokens fed back while decoding (the last new token
        # is not): the rest of the prompt is prefilled into the fetched KV in place, and so are they
        in_place = predicts_in_pass(km.model)
        # layered: the fetch goes on while the prefill runs, each layer once its KV is in place
        reuse = client.reuse(tokens, fingerprint=km.fingerprint, kv_shape=km.kv_shape, chunk_size=km.chunk_size,
                             max_tokens=len(tokens) - 1, bos_token_id=getattr(km.tokenizer, "bos_token_id", None),
                             room_tokens=len(tokens) + max_new_tokens - 1 if in_place else 0,
                             layered=in_place and (client.config.layered if client.config.layered is not None
                                                   else pays(km.model)))
    else:
        reuse = Reuse(None, 0, 0, 0, ())
    t1 = time.perf_counter()
    layered = reuse.gate is not None

    written = False
    with torch.inference_mode():
        tb = time.perf_counter()
        if reuse.room is not None:
            # the rest of the prompt prefilled into the fetched KV's room: no copy of the reused KV
            tp = time.perf_counter()
            cache, logits, reuse = _prefill_reused(km, client, reuse, tokens)
        else:
            if reuse.kv is not None:
                # reuse.kv (L, 2, H, N, D) -> per layer keys/values (1, H, N, D)
                cache = cache_from_layers([(reuse.kv[l, 0].unsqueeze(0), reuse.kv[l, 1].unsqueeze(0))
                                           for l in range(reuse.kv.shape[0])], km.config)
            else:
                cache = cache_from_layers([], km.config)
            tp = time.perf_counter()
            ids = torch.tensor([tokens[reuse.tokens:]], dtype=torch.long)  # (1, R)
            out = forward(km.model, input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
            cache, logits = output_cache(out), out.logits[0, -1]
        tf = time.perf_counter()
        # a layered fetch's time overlaps the prefill: keys_s is what reuse() spent outside it
        keys_s = max(0.0, (t1 - t0) - reuse.lookup_s - (0.0 if layered else reuse.fetch_s))
        nxt = int(torch.argmax(logits).item())
        t_first = time.perf_counter()
        if client is not None and write_back and reuse.edge_usable:
            # the layers' tensors are replaced, not mutated, by later steps: safe to encode later
            layers = [(layer.keys, layer.values) for layer in cache.layers]
            start = reuse.chunks if reuse.warning else reuse.available
            # the tail pieces reused were after the prompt's last full chunk only if no chunk was computed
            piece_start = reuse.pieces if start >= len(reuse.keys) else 0
            written = client.schedule_write_back(layers, list(reuse.keys), fingerprint=km.fingerprint,
                                                 chunk_size=km.chunk_size, start=start, tokens=tokens,
                                                 piece_start=piece_start)
        generated = greedy_tail(km.model, cache, nxt, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    t_end = time.perf_counter()
    timings = Timings(
        ttft_s=t_first - t_start, keys_s=keys_s, lookup_s=reuse.lookup_s, fetch_s=reuse.fetch_s,
        decode_s=reuse.decode_s, build_s=tp - tb, prefill_s=tf - tp, first_token_s=t_first - tf,
        total_s=t_end - t_start,
    )
    text = km.tokenizer.decode(generated) if km.tokenizer is not None else None
    return Result(
        tokens=generated, text=text, timings=timings, prompt_tokens=len(tokens), reused_tokens=reuse.tokens,
        computed_tokens=len(tokens) - reuse.tokens, fetched_bytes=reuse.bytes, via=reuse.via,
        written_back=written, warnings=(reuse.warning,) if reuse.warning else (),
    )
