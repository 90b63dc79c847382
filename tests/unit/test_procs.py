"""kdn.procs.start_local_ray: one more start after Ray's fixed 30 s raylet wait ran out, never more."""

from __future__ import annotations

import pytest

from kdn.procs import start_local_ray


def test_a_node_that_timed_out_starting_is_shut_down_and_started_once_more(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    calls: list[str] = []

    def init(**kw: object) -> None:
        calls.append(f"init {kw}")
        if len(calls) == 1:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("shutdown"))
    start_local_ray(num_cpus=2)
    assert calls == ["init {'num_cpus': 2}", "shutdown", "init {'num_cpus': 2}"]


def test_other_errors_and_a_second_timeout_are_raised_as_ray_raised_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setattr(ray, "shutdown", lambda: None)

    def bad(**kw: object) -> None:
        raise ValueError("resources must be a dict")

    monkeypatch.setattr(ray, "init", bad)
    with pytest.raises(ValueError, match="resources"):
        start_local_ray(num_cpus=2)

    tries = []

    def slow(**kw: object) -> None:
        tries.append(1)
        raise Exception("The current node timed out during startup.")

    monkeypatch.setattr(ray, "init", slow)
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_ray(num_cpus=2)
    assert len(tries) == 2
