"""Issue 17 item 13: where `kdn ingest` prefills (the decision as data: no Ray, no sockets)."""

from __future__ import annotations

import pytest

from kdn.errors import InvalidInput
from kdn.origin.ingest.where import decide

CLUSTER = {"RAY_ADDRESS": "10.0.0.5:6379"}


def test_with_ray_address_exported_it_uses_the_cluster_one_worker_per_origin_node():
    p = decide(workers=None, local=False, ray_address=None, env=CLUSTER)
    assert (p.mode, p.workers, p.address) == ("cluster", None, "10.0.0.5:6379")
    assert "RAY_ADDRESS is set" in p.describe() and "--local" in p.describe()
    assert "3 Ray worker(s) of the cluster at 10.0.0.5:6379" in p.describe(3)


def test_without_a_cluster_it_runs_in_this_process_and_says_how_to_use_one():
    p = decide(workers=None, local=False, ray_address=None, env={})
    assert (p.mode, p.workers) == ("local", 0)
    assert "in this process" in p.describe() and "kdn up" in p.describe()
    assert decide(workers=None, local=False, ray_address=None, env={"RAY_ADDRESS": "  "}).mode == "local"


def test_local_and_workers_zero_override_an_exported_cluster():
    assert decide(workers=None, local=True, ray_address=None, env=CLUSTER).mode == "local"
    assert decide(workers=0, local=False, ray_address=None, env=CLUSTER).mode == "local"
    assert "--local" in decide(workers=None, local=True, ray_address=None, env=CLUSTER).describe()


def test_workers_n_joins_the_named_cluster_or_starts_a_local_ray():
    p = decide(workers=2, local=False, ray_address=None, env=CLUSTER)
    assert (p.mode, p.workers, p.address) == ("cluster", 2, "10.0.0.5:6379")
    p = decide(workers=2, local=False, ray_address=None, env={})
    assert (p.mode, p.workers, p.address) == ("new-ray", 2, None)
    assert "new local Ray" in p.describe()


def test_ray_address_flag_wins_over_the_environment():
    p = decide(workers=None, local=False, ray_address="127.0.0.1:7000", env=CLUSTER)
    assert (p.mode, p.address) == ("cluster", "127.0.0.1:7000") and "--ray-address" in p.reason


def test_local_with_workers_is_refused():
    with pytest.raises(InvalidInput, match="contradict"):
        decide(workers=2, local=True, ray_address=None, env={})


def test_cli_without_ray_address_says_it_prefills_in_this_process(tmp_path, capsys, monkeypatch):
    from kdn.origin.cli import main_ingest

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "a.md").write_text("A document about caches. " * 20)
    assert main_ingest([str(tmp_path / "a.md"), "--model", "tiny", "--store", str(tmp_path / "store"), "--codec", "raw"]) == 0
    captured = capsys.readouterr()
    assert "prefilling in this process, no Ray (no RAY_ADDRESS" in captured.err
    assert "in this process" in captured.out  # the summary says it too


def test_cli_local_with_workers_is_one_clear_error(tmp_path, capsys):
    from kdn.origin.cli import main_ingest

    (tmp_path / "a.md").write_text("A document about caches. " * 20)
    assert main_ingest([str(tmp_path / "a.md"), "--model", "tiny", "--store", str(tmp_path / "store"),
                        "--local", "--workers", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "contradict" in err
