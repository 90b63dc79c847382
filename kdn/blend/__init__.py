"""Non-prefix reuse: documents' KV (segments) re-placed anywhere in a prompt, partly recomputed.

- :mod:`kdn.blend.rope` — moving stored keys to another position (any HF RoPE variant that is a
  rotation: default, linear, llama3, yarn; partial rotary), verified per model, refused otherwise;
- :mod:`kdn.blend.recompute` — :func:`place` (naive concatenation at the right positions) and
  :func:`blend` (recompute the tokens a policy picks: CacheBlend's deviation rule, EPIC's first-k,
  a random control).

A contract-floor module like :mod:`kdn.prefill`: the inference host (``kdn.integrations``), the
store (``kdn.origin.blend``) and the quality harness (``kdn.lab``) run the same code.
"""

from kdn.blend.recompute import (
    BlendStats, Deviation, FirstK, Glue, Layout, Naive, Policy, Random, blend, blend_and_predict, check_model, place,
    predicts_in_pass, prefill_document, prefill_in_place, prefill_segment,
)
from kdn.blend.rope import SUPPORTED_ROPE_TYPES, RopeSpec, rope_spec

__all__ = [
    "BlendStats", "Deviation", "FirstK", "Glue", "Layout", "Naive", "Policy", "Random", "RopeSpec", "SUPPORTED_ROPE_TYPES",
    "blend", "blend_and_predict", "check_model", "place", "predicts_in_pass", "prefill_document", "prefill_in_place",
    "prefill_segment", "rope_spec",
]
