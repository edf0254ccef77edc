"""Imported once by the server that the test ranks are forked from (conftest.run_ranks): it
captures a two-layer model, so that what torch imports lazily on a process' first capture
(torch.export, dynamo, aot_autograd: about 700 modules) is imported in the server, not again
on every rank of every test (seconds each on two busy cores). tests/test_conftest.py checks that
the ranks have it."""
from __future__ import annotations

import torch

from hidup.graph.capture import capture


class _TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.outer(torch.relu(self.inner(x))).sum()


capture(_TwoLayers(), (torch.randn(2, 4),))
