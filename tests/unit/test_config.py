"""Role configs: validated on construction, unknown keys refused by name, file + flag overrides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import Field, SecretStr, ValidationError

from kdn.config import RoleConfig, cluster_key_rule, refuse_when
from kdn.errors import ConfigError


class EdgeLikeConfig(RoleConfig):
    """A stand-in role config with the kinds of fields real roles have."""

    node_id: str = Field("edge-0", description="name of this node")
    port: int = Field(0, ge=0, le=65535, description="gRPC port; 0 = pick one")
    memory_bytes: int = Field(1 << 30, gt=0)
    codec: str = "zstd"
    peers: list[str] = Field(default_factory=list)


class RuledConfig(RoleConfig):
    """Fields checked by the shared validators."""

    codec: str = "zstd"
    sizes: list[int] = Field(default_factory=lambda: [1, 2])
    cluster_key: SecretStr | None = None

    _codec_known = refuse_when("codec", bad=lambda v: v not in ("zstd", "raw"), why=lambda v: f"unknown codec {v!r}")
    _sizes_positive = refuse_when("sizes", bad=lambda v: any(n <= 0 for n in v), why="sizes must be positive")
    _cluster_key_long = cluster_key_rule()


def test_shared_validators_refuse_naming_the_field_and_pass_the_rest() -> None:
    assert RuledConfig.build(codec="raw", sizes=[3], cluster_key="k" * 16).codec == "raw"
    with pytest.raises(ConfigError, match="codec: Value error, unknown codec 'lz9'"):
        RuledConfig.build(codec="lz9")
    with pytest.raises(ConfigError, match="sizes: Value error, sizes must be positive"):
        RuledConfig.build(sizes=[1, 0])
    with pytest.raises(ConfigError, match="cluster_key: Value error, cluster_key must be at least 16 characters"):
        RuledConfig.build(cluster_key="short")


def test_default_reads_the_field() -> None:
    assert EdgeLikeConfig.default("memory_bytes") == 1 << 30
    assert EdgeLikeConfig.default("peers") == []


def test_defaults_are_valid() -> None:
    cfg = EdgeLikeConfig.build()
    assert cfg.port == 0 and cfg.codec == "zstd" and cfg.peers == []


def test_unknown_key_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="memroy_bytes"):
        EdgeLikeConfig.build({"memroy_bytes": 5})
    with pytest.raises(ConfigError, match="bogus"):
        EdgeLikeConfig.build(bogus=1)


def test_direct_construction_also_refuses_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="nope"):
        EdgeLikeConfig(nope=1)  # type: ignore[call-arg]


def test_bad_value_names_the_field() -> None:
    with pytest.raises(ConfigError, match="port") as exc:
        EdgeLikeConfig.build({"port": 70000})
    assert "EdgeLikeConfig" in str(exc.value)
    with pytest.raises(ConfigError, match="memory_bytes"):
        EdgeLikeConfig.build(memory_bytes=-1)
    assert isinstance(exc.value, ValueError)  # ConfigError is a ValueError too


def test_config_is_frozen() -> None:
    cfg = EdgeLikeConfig.build()
    with pytest.raises(ValidationError):
        cfg.port = 5  # type: ignore[misc]


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_file_then_overrides(tmp_path: Path, suffix: str) -> None:
    data = {"node_id": "edge-7", "port": 5000, "peers": ["a:1", "b:2"]}
    path = tmp_path / f"edge{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(data))
    else:
        path.write_text("node_id: edge-7\nport: 5000\npeers: [a:1, b:2]\n")
    cfg = EdgeLikeConfig.from_file(path)
    assert (cfg.node_id, cfg.port, cfg.peers) == ("edge-7", 5000, ["a:1", "b:2"])
    # a flag overrides the file; a flag left unset (None) does not
    cfg2 = EdgeLikeConfig.from_file(path, port=6000, node_id=None)
    assert (cfg2.node_id, cfg2.port) == ("edge-7", 6000)


def test_file_errors_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        EdgeLikeConfig.from_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("port: [unclosed\n")
    with pytest.raises(ConfigError, match="does not parse") as raised:
        EdgeLikeConfig.from_file(bad)
    assert "\n" not in str(raised.value) and "line 2" in str(raised.value)  # one line, saying where
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"port": 1,\n}')
    with pytest.raises(ConfigError, match="does not parse") as raised:
        EdgeLikeConfig.from_file(bad_json)
    assert "\n" not in str(raised.value)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        EdgeLikeConfig.from_file(listy)
    typo = tmp_path / "typo.yaml"
    typo.write_text("prot: 1\n")
    with pytest.raises(ConfigError, match=r"prot") as exc:
        EdgeLikeConfig.from_file(typo)
    assert str(typo) in str(exc.value)


def test_empty_file_gives_defaults(tmp_path: Path) -> None:
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert EdgeLikeConfig.from_file(empty) == EdgeLikeConfig.build()


def test_every_role_config_in_the_project_refuses_unknown_keys() -> None:
    """Whatever role configs other modules define, none may accept a typo silently."""
    import importlib
    import pkgutil

    import kdn

    # every module of the one import root whose name says it holds configuration
    for mod in pkgutil.walk_packages(kdn.__path__, "kdn."):
        if mod.name.rsplit(".", 1)[-1].endswith(("config", "settings")):
            importlib.import_module(mod.name)
    seen = []
    stack = list(RoleConfig.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__ == __name__:
            continue
        seen.append(cls)
        assert cls.model_config.get("extra") == "forbid", f"{cls.__qualname__} accepts unknown keys"
