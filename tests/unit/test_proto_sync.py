"""The committed protobuf/gRPC stubs match kdn/proto/kdn.proto.

Regenerates the stubs with grpc_tools into a temporary directory and compares them with the
committed files. Lines that only name the generator's version are ignored, so a newer grpcio-tools
alone does not fail the test; any schema change without regenerating does.
"""

from __future__ import annotations

import difflib
import re
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTO = Path("kdn/proto/kdn.proto")
GENERATED = ("kdn_pb2.py", "kdn_pb2_grpc.py", "kdn_pb2.pyi")
REGENERATE = (
    "python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. kdn/proto/kdn.proto"
    "   (run from the repository root)"
)

_VERSION_NOISE = [
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:.*\n)*?\)\n", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
]


def _normalise(text: str) -> str:
    for pattern in _VERSION_NOISE:
        text = pattern.sub("<generator version>", text)
    return text


def _protoc(cwd: Path) -> None:
    """Run grpc_tools' protoc in ``cwd`` exactly as the regenerate command does."""
    import os

    from grpc_tools import protoc  # a dev dependency: a missing one must fail, not skip, this check
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = ["grpc_tools.protoc", "-I.", f"-I{include}", "--python_out=.", "--pyi_out=.", "--grpc_python_out=.", str(PROTO)]
    old = os.getcwd()
    os.chdir(cwd)
    try:
        rc = int(protoc.main(args))
    finally:
        os.chdir(old)
    assert rc == 0, f"protoc failed with exit code {rc}"


def _regenerate(out: Path) -> Path:
    (out / PROTO.parent).mkdir(parents=True)
    shutil.copy(REPO / PROTO, out / PROTO)
    _protoc(out)
    return out / PROTO.parent


@pytest.mark.parametrize("name", GENERATED)
def test_committed_stub_matches_proto(tmp_path: Path, name: str) -> None:
    fresh_dir = _regenerate(tmp_path)
    fresh = _normalise((fresh_dir / name).read_text())
    committed_path = REPO / PROTO.parent / name
    assert committed_path.is_file(), f"{committed_path} is missing; regenerate with:\n  {REGENERATE}"
    committed = _normalise(committed_path.read_text())
    if fresh != committed:
        diff = "".join(
            list(
                difflib.unified_diff(
                    committed.splitlines(True), fresh.splitlines(True), f"committed/{name}", f"regenerated/{name}", n=1
                )
            )[:40]
        )
        pytest.fail(f"{name} is stale relative to {PROTO}. Regenerate with:\n  {REGENERATE}\n\n{diff}")


def test_normalisation_keeps_schema_changes_visible(tmp_path: Path) -> None:
    """The version filter must not hide a real change: an extra field alters the stub text."""
    fresh_dir = _regenerate(tmp_path)
    before = _normalise((fresh_dir / "kdn_pb2.pyi").read_text())
    proto = tmp_path / PROTO
    proto.write_text(proto.read_text().replace("double created_unix = 15;", "double created_unix = 15;\n  uint32 extra = 99;"))
    for name in GENERATED:
        (fresh_dir / name).unlink()
    _protoc(tmp_path)
    assert _normalise((fresh_dir / "kdn_pb2.pyi").read_text()) != before


def test_version_lines_are_the_only_thing_filtered() -> None:
    for name in ("kdn_pb2.py", "kdn_pb2_grpc.py"):
        text = (REPO / PROTO.parent / name).read_text()
        normalised = _normalise(text)
        assert "<generator version>" in normalised, f"version filter no longer matches {name}"
        assert len(text) - len(normalised) < 300
