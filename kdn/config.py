"""Typed configuration shared by every role.

Each role (origin, edge, client) has one pydantic model derived from :class:`RoleConfig`:
validated on construction, unknown keys refused, loadable from a YAML or JSON file, and
overridable by command-line flags. Defaults live on the model fields and nowhere else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Self

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from kdn.errors import ConfigError

__all__ = ["RoleConfig", "cache_root", "cluster_key_rule", "refuse_when"]


def cache_root(env: dict[str, str] | None = None) -> Path:
    """Where KDN keeps what it makes for this user: ``$KDN_CACHE`` or ``~/.cache/kdn`` (trained
    models, blend verdicts, key-edit calibrations); never inside the repository."""
    env = os.environ if env is None else env
    return Path(env.get("KDN_CACHE") or Path.home() / ".cache" / "kdn").expanduser()


def measured_file(name: str, root: Path | None, own: Path, shipped: Path) -> Path:
    """Where a per-model measurement file ``name`` (a blend verdict, a key-edit calibration) is
    read from: ``root/name`` when a root is given; else this machine's own (``own/name``) where it
    exists, else the one KDN ships for a built-in model (``shipped/name``, which may not exist)."""
    if root is not None:
        return root / name
    path = own / name
    return path if path.is_file() else shipped / name


class RoleConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    @classmethod
    def default(cls, field: str) -> Any:
        """The model's default for ``field``, for a component that also takes the setting on its own
        (so the value is written once, on the field)."""
        return cls.model_fields[field].get_default(call_default_factory=True)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> Self:
        """Load from YAML/JSON, then apply ``overrides`` (flags); ``None`` overrides are ignored."""
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start}): not a YAML/JSON config") from exc
        try:
            data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as exc:
            mark = getattr(exc, "problem_mark", None)  # YAML's report spans lines: its problem and where
            why = (f"{getattr(exc, 'problem', None) or 'a YAML error'} at line {mark.line + 1}, column {mark.column + 1}"
                   if mark is not None else " ".join(str(exc).split()))
            raise ConfigError(f"config file {p} does not parse: {why}") from exc
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping, not {type(data).__name__}")
        return cls.build({**data, **{k: v for k, v in overrides.items() if v is not None}}, source=str(p))

    @classmethod
    def build(cls, data: dict[str, Any] | None = None, *, source: str = "flags", **overrides: Any) -> Self:
        """Validate ``data`` plus non-``None`` ``overrides``; errors name the field."""
        merged = {**(data or {}), **{k: v for k, v in overrides.items() if v is not None}}
        try:
            return cls(**merged)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"invalid {cls.__name__} from {source}: {problems}") from None


def check_address(value: str, what: str, *, port_zero: bool = False, unix: bool = False) -> str:
    """``value`` when it is ``host:port`` (``port_zero``: port 0 too, a listener's "any free
    port"; ``unix``: or ``unix:PATH``); else ConfigError (a ValueError, so pydantic reports it
    against the field) naming ``what``."""
    if unix and value.startswith("unix:") and len(value) > len("unix:"):
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if port_zero else 1) <= int(port) <= 65535:
        raise ConfigError(f"{what} must be host:port{' (or unix:PATH)' if unix else ''}, got {value!r}")
    return value


def refuse_when(*fields: str, bad: Callable[[Any], bool], why: str | Callable[[Any], str]) -> Any:
    """A field validator for a config model's class body: a value for which ``bad`` holds is refused
    with ``ValueError(why)`` (``why(value)`` when it is callable), pydantic naming the field; any
    other value passes unchanged."""

    def check(cls: type, v: Any) -> Any:
        if bad(v):
            raise ValueError(why(v) if callable(why) else why)
        return v

    return field_validator(*fields)(check)


def cluster_key_rule() -> Any:
    """The ``cluster_key`` field's validator, for every role that holds the cluster's shared secret."""
    return refuse_when("cluster_key", bad=lambda v: v is not None and len(v.get_secret_value()) < 16,
                       why="cluster_key must be at least 16 characters")
