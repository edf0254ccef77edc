"""The test harness itself: the gloo ranks of `conftest.run_ranks` are forked from a server
that has already imported torch.export (tests/rank_preload.py), so that no rank pays for it; the
worker processes of `conftest.start_workers` take every unit once and give results in order."""
from __future__ import annotations

import os
import sys

from conftest import by_model, ranks_and_workers, run_ranks, start_workers


def _imported(rank, world):
    return "torch.export._trace" in sys.modules, "torch._dynamo" in sys.modules


def test_the_ranks_start_with_torch_export_imported():
    # Python 3.11's forkserver skips a preload it cannot import without a word: this fails if
    # rank_preload is not found there (conftest._tests_importable)
    assert run_ranks(2, _imported) == [(True, True), (True, True)]


def _unit(unit, folder):
    open(os.path.join(folder, f"{unit}-{os.getpid()}"), "w").close()  # one file per run of it
    return unit * 10, os.getpid()


def test_workers_take_each_unit_once_and_give_results_in_order(tmp_path):
    with start_workers(_unit, list(range(7)), str(tmp_path)) as workers:
        results = workers.results()
    assert [r for r, _ in results] == [10 * i for i in range(7)]
    assert sorted(int(f.name.split("-")[0]) for f in tmp_path.iterdir()) == list(range(7))
    assert 1 <= len({pid for _, pid in results}) <= (os.cpu_count() or 1)
    assert os.getpid() not in {pid for _, pid in results}


def _per_rank(rank, world, cases):
    return {c: ("rank", rank) for c in cases}


def _threads(cases, world):
    return [{c: ("worker", rank) for c in cases} for rank in range(world)]


def test_ranks_and_workers_merge_their_cases_per_rank():
    cases = [("a", 1), ("b", 1), ("a", 2)]
    assert [[c[0] for c in group] for group in by_model(cases)] == [["a", "a"], ["b"]]
    out, extra = ranks_and_workers(2, (_per_rank, [("t", 1)]), (_threads, cases), lambda: "here")
    assert extra == "here"
    assert out == [{("t", 1): ("rank", r), **{c: ("worker", r) for c in cases}} for r in (0, 1)]
