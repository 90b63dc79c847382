"""Inference-engine integrations: each reuses KDN's KV through :mod:`kdn.client`.

- :mod:`kdn.integrations.transformers`: Hugging Face causal LMs with a ``DynamicCache``
  (``prepare``, ``generate``).
"""
