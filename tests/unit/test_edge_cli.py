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


def test_bad_flags_and_files_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 19: binary config, absurd byte bounds, priority past int32, ttl NaN: a clear error
    (argparse's usage line, or one ``kdn edge: ...`` line), never a traceback or a silent success."""
    from kdn.edge.cli import main
    from kdn.edge.config import EdgeConfig

    binary = tmp_path / "edge.yaml"
    binary.write_bytes(bytes(range(256)) * 4)
    assert main(["--config", str(binary)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kdn edge:") and "\n" not in err and "Traceback" not in err

    for absurd in (1e29, 10**18, float("inf")):
        with pytest.raises(ConfigError, match="memory_bytes"):
            EdgeConfig.build({"memory_bytes": absurd})
    (tmp_path / "big.json").write_text('{"memory_bytes": 1e29}')
    assert main(["--config", str(tmp_path / "big.json")]) == 2
    assert "memory_bytes" in capsys.readouterr().err
    for size in ("infG", "nanG", "1e400"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(size)

    key = "ab" * 32
    for argv in (["priority", "--edge", "127.0.0.1:1", "--priority", "99999999999", key],
                 ["ttl", "--edge", "127.0.0.1:1", "--seconds", "nan", key],
                 ["ttl", "--edge", "127.0.0.1:1", "--seconds", "inf", key],
                 ["ttl", "--edge", "127.0.0.1:1", "--seconds", "-1", key]):
        with pytest.raises(SystemExit) as exc:
            main(argv)  # refused before anything is sent
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("priority" in err or "seconds" in err)


def test_the_edge_refuses_a_nan_ttl_instead_of_clearing_ttls() -> None:
    import asyncio

    from kdn.edge.operator_hints import HintService
    from kdn.testing import InMemoryOverlay, make_chain, origin_with
    from kdn.errors import InvalidInput
    from kdn.proto import kdn_pb2 as pb

    chain = make_chain(1)

    async def main() -> None:
        async with InMemoryOverlay(1, origin=origin_with([chain])) as ov:
            node = ov.nodes["e0"]
            node.store.put(chain.blobs[0], tenant="default", ttl_s=60)
            hints = HintService(node, disk_dir=None, clock=ov.clock)
            for bad in (float("nan"), float("inf"), -1.0):
                req = pb.HintRequest(action=pb.HintRequest.SET_TTL, ttl_s=bad)
                with pytest.raises(InvalidInput):
                    await hints.apply(req, chain.namespace, None, chain.keys)
            assert node.store.entries()[0].ttl_left_s == pytest.approx(60)  # the TTL is still there

    asyncio.run(main())


def test_a_missing_tls_file_is_one_line_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kdn.edge.cli import main_stats

    missing = tmp_path / "nope.pem"
    assert main_stats(["--edge", "127.0.0.1:9", "--tls-ca", str(missing)]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"--tls-ca {missing}: no such file" in err
    assert main_stats(["--edge", "127.0.0.1:9", "--tls-ca", str(missing), "--json"]) != 0
    out = json.loads(capsys.readouterr().out)
    assert out["error"] == "ConfigError" and "--tls-ca" in out["message"]


def test_webrtc_flags_reach_the_config_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    f = tmp_path / "edge.yaml"
    f.write_text("node_id: nat-a\nrtc_ice_servers: [{urls: ['stun:203.0.113.10:3478']}]\n")
    cfg = build_config(_run_parser().parse_args(["--config", str(f), "--rtc-signal", "203.0.113.10:50051",
                                                  "--rtc-mode", "always", "--rtc-link-codec", "raw"]))
    assert (cfg.rtc_signal, cfg.rtc_mode, cfg.rtc_link_codec) == ("203.0.113.10:50051", "always", "")
    assert [s.urls for s in cfg.rtc_ice_servers] == [["stun:203.0.113.10:3478"]]  # the file's, kept
    assert build_config(_run_parser().parse_args([])).rtc_link_codec == "zstd:1"
    with pytest.raises(ConfigError, match="rtc_link_codec"):
        build_config(_run_parser().parse_args(["--rtc-link-codec", "kvq:q5"]))  # lossy: refused
    with pytest.raises(ConfigError, match="rtc_signal"):
        build_config(_run_parser().parse_args(["--rtc-signal", "no-port"]))
    with pytest.raises(SystemExit):
        _run_parser().parse_args(["--rtc-mode", "sometimes"])
