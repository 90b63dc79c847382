"""``int8``: symmetric 8-bit quantisation (lossy, 2x smaller than fp16, 4x than fp32).

Keys have outlier *channels* (a few head-dim columns much larger than the rest), so keys get one
scale per ``(head, channel)``; values vary per *token*, so values get one scale per
``(head, token)``. Scales are fp32. Reconstruction error is at most half a step per element:
``|x - x̂| <= scale / 2`` with ``scale = max|x| / 127`` over the scale's group.
"""

from __future__ import annotations

import numpy as np
import torch

from kdn.codecs.base import Codec, SectionInfo, register_codec
from kdn.errors import ArtifactCorrupt


@register_codec
class Int8Codec(Codec):
    name = "int8"
    lossy = True

    @staticmethod
    def _scale_shape(info: SectionInfo) -> tuple[int, int, int]:
        h, t, d = info.shape
        return (h, 1, d) if info.kind == "k" else (h, t, 1)

    def encode(self, x: torch.Tensor, info: SectionInfo) -> bytes:
        xf = x.float()  # (H, T, D)
        reduce_dim = 1 if info.kind == "k" else 2  # keys: over tokens (per channel); values: over channels
        scale = xf.abs().amax(dim=reduce_dim, keepdim=True).clamp_min(1e-12) / 127.0
        q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
        return scale.numpy().astype("<f4").tobytes() + q.numpy().tobytes()

    def decode(self, payload: memoryview, info: SectionInfo) -> torch.Tensor:
        sshape = self._scale_shape(info)
        n_scale = int(np.prod(sshape))
        h, t, d = info.shape
        if len(payload) != 4 * n_scale + h * t * d:
            raise ArtifactCorrupt(f"int8 section is {len(payload)} bytes, expected {4 * n_scale + h * t * d}")
        scale = torch.from_numpy(np.frombuffer(payload, dtype="<f4", count=n_scale).copy()).reshape(sshape)
        q = torch.from_numpy(np.frombuffer(payload, dtype=np.int8, offset=4 * n_scale).copy()).reshape(info.shape)
        return (q.float() * scale).to(info.dtype)

    def max_payload(self, info: SectionInfo) -> int:
        h, t, d = info.shape
        return 4 * int(np.prod(self._scale_shape(info))) + h * t * d
