"""The test harness itself: the gloo ranks of `conftest.run_ranks` are forked from a server
that has already imported torch.export (tests/rank_preload.py), so that no rank pays for it."""
from __future__ import annotations

import sys

from conftest import run_ranks


def _imported(rank, world):
    return "torch.export._trace" in sys.modules, "torch._dynamo" in sys.modules


def test_the_ranks_start_with_torch_export_imported():
    # Python 3.11's forkserver skips a preload it cannot import without a word: this fails if
    # rank_preload is not found there (conftest._tests_importable)
    assert run_ranks(2, _imported) == [(True, True), (True, True)]
