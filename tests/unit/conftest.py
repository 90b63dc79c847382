"""Unit tests never start Ray or open network sockets (Ray Serve's ``tests/unit/conftest.py`` idea).

``ray.init`` raises, and so do ``bind``/``connect`` on internet sockets. Unix socket pairs stay
allowed: asyncio's event loop uses one internally. Tests that need Ray or gRPC belong in
``tests/integration/`` with ``pytestmark = pytest.mark.integration``.
"""

from __future__ import annotations

import socket

import pytest

_INET = (socket.AF_INET, socket.AF_INET6)


class NetworkInUnitTest(RuntimeError):
    """A unit test tried to use Ray or an internet socket."""


@pytest.fixture(autouse=True)
def _no_ray_init(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency, but the guard must not need it
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise NetworkInUnitTest("unit tests must not start Ray; move this test to tests/integration/")

    monkeypatch.setattr(ray, "init", refuse)


@pytest.fixture(autouse=True)
def _no_inet_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    real_bind, real_connect, real_connect_ex = socket.socket.bind, socket.socket.connect, socket.socket.connect_ex

    def guard(real):  # type: ignore[no-untyped-def]
        def wrapper(self: socket.socket, *args: object, **kwargs: object):  # type: ignore[no-untyped-def]
            if self.family in _INET:
                raise NetworkInUnitTest(
                    f"unit tests must not open network sockets ({real.__name__}{args!r}); "
                    "move this test to tests/integration/"
                )
            return real(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(socket.socket, "bind", guard(real_bind))
    monkeypatch.setattr(socket.socket, "connect", guard(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", guard(real_connect_ex))
