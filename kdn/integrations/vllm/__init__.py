"""KDN for vLLM: the v1 KV connector vLLM loads by module path ``kdn.integrations.vllm``.

- :mod:`~kdn.integrations.vllm.connector` — :class:`KdnConnector`, the class vLLM loads (the
  scheduler's Lookup and plan, the worker's load and save), its config and metadata;
- :mod:`~kdn.integrations.vllm.load` — the worker's loads of one step (:class:`LoadJob`);
- :mod:`~kdn.integrations.vllm.paged` — the engine's paged KV: slot mapping, block gather and
  scatter, the attention backends' layouts (:class:`PagedKV`).

Importing this package imports vLLM's connector base classes.
"""

from kdn.integrations.vllm.connector import (
    KdnConnector, KdnConnectorConfig, KdnConnectorMetadata, KdnConnectorStats, SaveSpec, engine_fingerprint,
    request_namespace,
)
from kdn.integrations.vllm.load import LoadContext, LoadJob, LoadSpec, LoopThread
from kdn.integrations.vllm.paged import EngineGeometry, PagedCache, PagedKV

__all__ = [
    "KdnConnector", "KdnConnectorConfig", "KdnConnectorMetadata", "KdnConnectorStats", "SaveSpec", "engine_fingerprint",
    "request_namespace", "LoadContext", "LoadJob", "LoadSpec", "LoopThread", "EngineGeometry", "PagedCache", "PagedKV",
]
