"""kdn edge flag parsing and config building (no server started)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kdn.edge.cli import _run_parser, build_config, parse_bytes, parse_peers, parse_tokens
from kdn.errors import ConfigError


def test_parsers() -> None:
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("10G") == 10 << 30 and parse_bytes("1234") == 1234
    assert parse_bytes("2GiB") == 2 << 30
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes("lots")
    assert parse_peers("a=127.0.0.1:1,b=h:2") == {"a": "127.0.0.1:1", "b": "h:2"}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_peers("a127.0.0.1:1")
    assert parse_tokens(["t1=acme,globex", "t2=*"]) == {"t1": ["acme", "globex"], "t2": ["*"]}
    with pytest.raises(ConfigError):
        parse_tokens(["t1"])


def test_flags_override_file(tmp_path: Path) -> None:
    f = tmp_path / "edge.yaml"
    f.write_text("node_id: from-file\nmemory_bytes: 1000\npolicy: lru\npeers: {b: '127.0.0.1:2'}\n")
    args = _run_parser().parse_args(["--config", str(f), "--memory-bytes", "2K", "--token-grant", "tok=acme"])
    cfg = build_config(args)
    assert cfg.node_id == "from-file" and cfg.memory_bytes == 2048 and cfg.policy == "lru"
    assert cfg.peers == {"b": "127.0.0.1:2"} and cfg.tokens == {"tok": ["acme"]}
    with pytest.raises(ConfigError, match="policy"):
        build_config(_run_parser().parse_args(["--policy", "nope"]))
    with pytest.raises(ConfigError, match="listen"):
        build_config(_run_parser().parse_args(["--listen", "nowhere"]))
