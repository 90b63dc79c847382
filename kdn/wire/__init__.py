"""The wire: everything that crosses between a host, an edge, a peer edge and the origin.

The only place protobuf messages meet KDN's types and gRPC statuses meet KDN's errors; the host
client (:mod:`kdn.transport`), the edge's upstreams (:mod:`kdn.edge.upstream`) and the
admin client (:mod:`kdn.edge.admin`) are thin adapters over it, and the edge's and origin's
servicers only parse, authorize and call.

- :mod:`~kdn.wire.convert` — requests built and parsed (keys, fingerprints, namespaces — the
  empty-tenant rule — ``FetchSpec``, Put streams, stats);
- :mod:`~kdn.wire.frames` — ``FetchChunk`` framed and read by hand on the hot path (zero-copy);
  :mod:`~kdn.wire.calls` — the client side of a Fetch (raw call, bounded join);
- :mod:`~kdn.wire.errors` — the one status ↔ error table; ``rpc_errors()`` for clients;
- :mod:`~kdn.wire.service` — the one servicer envelope (``@rpc``) and ``add_servicer``;
- :mod:`~kdn.wire.auth` — bearer tokens → tenants; :mod:`~kdn.wire.tls` — TLS files and rules;
  :mod:`~kdn.wire.channel` — channel options, metadata, piece splitting;
- :mod:`~kdn.wire.shm` — the one reader of shared-memory segments an edge publishes;
- :mod:`~kdn.wire.inproc` — gRPC without sockets, for unit tests (real handlers, real bytes).

A later byte path beside gRPC (a bulk socket negotiated over gRPC) would be one more module here,
yielding pieces through the same ``EdgeTransport.fetch`` and verified by the same checksums.
"""
