"""Imported once by the server that the test ranks are forked from (conftest.run_ranks): it
captures the zoo's mlp:tiny, so that what torch imports lazily on a process' first capture
(torch.export, dynamo, aot_autograd: about 700 modules) is imported in the server, not again
on every rank of every test (seconds each on two busy cores). tests/test_conftest.py checks that
the ranks have it."""
from __future__ import annotations

import torch

from hidup.graph.capture import capture
from hidup.models import get_model

_spec = get_model("mlp:tiny")
capture(_spec.build(), _spec.inputs(_spec.batch, torch.Generator()))
