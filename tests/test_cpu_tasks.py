"""Claimed tasks in Numba parallel regions (gpu/cpu/tasks.py) and the threading layer they run on
(gpu/cpu/threading_layer.py)."""
from __future__ import annotations

import importlib.metadata
import os

import numba
import numpy as np
import pytest
from numba import njit, prange

from ringserve.gpu.cpu.tasks import claim, linear_tasks, num_tasks, task_counter


@njit(parallel=True, nogil=True)
def _claimed(hits, counter, heavy):
    """hits[i] += 1 for each task i a thread claims; task 0 spins `heavy` iterations first, so
    that the thread holding it falls behind the others."""
    tasks = hits.shape[0]
    counter[0] = 0
    for _ in prange(counter[1]):
        i = claim(counter)
        while i < tasks:
            if i == 0:
                acc = 0.0
                for j in range(heavy):
                    acc += np.sqrt(np.float64(j))
                hits[i] += 1 if acc >= 0 else 2
            else:
                hits[i] += 1
            i = claim(counter)


@pytest.mark.parametrize("tasks", [1, 2, 3, 64, 1000])
def test_every_task_is_claimed_exactly_once(tasks):
    counter = task_counter(tasks)
    assert 1 <= counter[1] <= min(tasks, numba.get_num_threads())
    assert counter.ctypes.data % 64 == 0  # a cache line of its own
    for rep in range(50):
        hits = np.zeros(tasks, np.int64)
        _claimed(hits, counter, 20_000 if rep % 2 else 0)
        assert np.array_equal(hits, np.ones(tasks, np.int64)), f"rep {rep}: {np.flatnonzero(hits != 1)}"
        assert counter[0] >= tasks  # every thread that ran claimed once past the end


def test_num_tasks_never_exceeds_the_row_blocks():
    assert num_tasks(1) == 1
    assert num_tasks(3) == 3
    assert num_tasks(10_000) == 8 * numba.get_num_threads()


def test_a_linears_tasks_and_counter_are_num_tasks_and_task_counters():
    threads = numba.get_num_threads()
    for units in (1, 3, 10_000):
        tasks, counter = linear_tasks(units)
        assert tasks == num_tasks(units)
        assert counter is task_counter(tasks) and counter[1] == min(threads, tasks)
    assert task_counter(50, 1)[1] == 1 and task_counter(1, 8)[1] == 1  # never more than asked, or than tasks


def _tbb_installed() -> bool:
    try:
        importlib.metadata.distribution("tbb")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _tbb_installed() or os.environ.get("NUMBA_THREADING_LAYER", "default") != "default",
                    reason="the tbb package is not installed here, or NUMBA_THREADING_LAYER chooses")
def test_parallel_regions_run_on_tbb_where_the_package_is_installed():
    hits = np.zeros(16, np.int64)
    _claimed(hits, task_counter(16), 0)  # the process's first region may be this one
    assert numba.threading_layer() == "tbb"
