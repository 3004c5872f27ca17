"""The -j worker processes start before the run is planned (ktconvert/convert/pool.py): the run takes that pool,
and a pool no run takes (the planning failed) is shut down, its workers gone."""

from __future__ import annotations

import multiprocessing

import pytest

from ktconvert.convert import api, pool
from ktconvert.errors import InputError


@pytest.fixture
def pools(monkeypatch):
    made = []
    real = pool._new_pool

    def counted(workers):
        made.append(real(workers))
        return made[-1]

    monkeypatch.setattr(pool, "_new_pool", counted)
    return made


def test_the_run_takes_the_pool_started_before_planning(tiny_root, tmp_path, pools):
    one = api.convert(tiny_root / "qwen3_moe", tmp_path / "j1", type="Q4_K", jobs=1)
    assert pools == []  # -j 1: no worker process at all
    two = api.convert(tiny_root / "qwen3_moe", tmp_path / "j2", type="Q4_K", jobs=2)
    assert len(pools) == 1 and pools[0]._max_workers == 1  # started ahead, taken by the run: no second pool
    assert pool._STARTED == []
    assert (one.out / "model.gguf").read_bytes() == (two.out / "model.gguf").read_bytes()
    assert not pools[0]._processes  # shut down by the run that took it


def test_a_pool_no_run_took_is_shut_down(tmp_path, pools):
    with pytest.raises(InputError):
        api.convert(tmp_path / "missing", tmp_path / "out", type="Q8_0", jobs=3)
    assert len(pools) == 1 and pools[0]._max_workers == 2
    assert pool._STARTED == [] and not pools[0]._processes
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]
    assert not (tmp_path / "out").exists()


def test_worker_pool_makes_one_when_none_was_started_ahead(pools):
    with pool.workers_started(2):
        got = pool.worker_pool(3)  # another size than the one started: a new pool
        assert got is pools[1] and pool._STARTED == [(1, pools[0])]
        got.shutdown()
        assert pool.worker_pool(1) is pools[0] and pool._STARTED == []
        pools[0].shutdown()


def test_a_ray_run_starts_no_local_worker(pools):
    """With ``--executor ray`` the tasks run in Ray's workers: no local pool is started ahead of the planning."""
    with pool.workers_started(3, "ray"):
        assert pools == [] and pool._STARTED == []
