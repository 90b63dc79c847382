"""A built-in spec saved as a model directory: what vLLM and the origin both load."""

from __future__ import annotations

import torch

from kdn.integrations.model_dir import save_builtin
from kdn.models import ByteTokenizer, load_model


def test_saved_directory_tokenizes_like_the_byte_tokenizer_and_keeps_the_weights(tmp_path):
    d = save_builtin("tiny", tmp_path / "tiny", dtype="bfloat16")
    lm = load_model(str(d), dtype="bfloat16", chunk_size=64)
    ref = load_model("tiny", dtype="bfloat16", chunk_size=64)
    for text in ["", "plain ascii", "naïve café – ünïcödé ✓", "line\nbreak\ttab"]:
        assert lm.tokenizer.encode(text) == ByteTokenizer().encode(text)
        assert lm.tokenizer.decode(lm.tokenizer.encode(text)) == text
    for (name, a), (_, b) in zip(lm.model.state_dict().items(), ref.model.state_dict().items()):
        assert torch.equal(a, b), name
    # the directory names its weights by their bytes, not by the built-in's seed
    assert lm.fingerprint != ref.fingerprint
    assert load_model(str(d), dtype="bfloat16", chunk_size=64).fingerprint == lm.fingerprint
