"""KDN, a Knowledge Delivery Network: a CDN for LLM KV caches.

One import root, five floors. A request's path reads off the folder names::

    kdn.client / kdn.integrations   the inference host: keys → Lookup → Fetch into its own KV → write back
        │  kdn.wire                 gRPC + shared memory: the only place messages are converted
        ▼
    kdn.edge                        the edge node: tiered store, eviction, overlay, coalescing, hints
        │  kdn.wire
        ▼
    kdn.origin                      the producer on Ray: ingest → prefill → encode → durable store

Floors (each may import only its own floor and the floors below it):

0. **contracts** — what every part agrees on and nothing else: ``errors``, ``keys``, ``kv``,
   ``models`` (and ``pretrained``: trained built-ins converted once), ``prompts`` (how a
   request's text becomes the engine's tokens), ``prefill``, ``artifact``, ``codecs``, ``placement``, ``config``, ``blobstore``,
   ``procs``, ``console``, ``proto`` (generated stubs).
1. **wire** — ``kdn.wire``: message conversions, the gRPC status ↔ error mapping (clients and the
   one servicer envelope), stream frames, the shm reader, auth, TLS, channels, in-process gRPC.
2. **KV operations** — ``kdn.segments`` (position-free document KV), ``kdn.blend`` (re-placing
   segments and recomputing a share of them, run by hosts and the lab) and ``kdn.steer`` (steered
   variants: their specs, chain roots and the methods the origin runs). They stand on contracts
   alone (not the wire).
3. **parts** — ``kdn.client`` (with ``kdn.layered``: a prefix fetched under the forward) and
   ``kdn.transport`` and ``kdn.integrations`` (the inference host), ``kdn.edge``, ``kdn.origin``, ``kdn.lab`` (reference models and quality
   harnesses), ``kdn.route`` (the KV-aware router in front of inference hosts). Parts never
   import each other, with three stated exceptions: an integration uses ``kdn.client``;
   ``kdn.route`` may use ``kdn.client``; ``kdn.simulator`` runs the edge's own policies
   (``kdn.edge``) and the router's scorer (``kdn.route.score``) under its clock.
4. **ops** — ``kdn.ops``: the ``kdn`` command, ``kdn up``/``down``, the Ray roles and registry,
   the demo. Only ops imports every part; nothing imports ops.

Beside them, ``kdn.testing`` holds the test doubles (an edge in a dict, in-process edges and
overlays, a dict origin, a fake clock): it may use the client and the edge, and nothing but tests
imports it.

Order within a floor, lowest first (a module imports only those before it; a package is one place):

- contracts: errors, console, procs, proto, config, blobstore, keys, kv, prompts, codecs, placement, pretrained, models, prefill, artifact
- wire: errors, frames, auth, tls, health, inproc, shm, channel, convert, calls, bulk, client_calls, service, origin, signal, rtc
- KV operations: segments, blend, steer

``tests/unit/test_layering.py`` enforces these rules and orders over every ``import`` in the tree
(function bodies included) and refuses import cycles between files.
"""
