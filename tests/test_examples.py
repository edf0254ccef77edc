"""The README's example runs as printed: a user's own model planned, predicted and trained with
AdamW on 2 gloo ranks (`torchrun --nproc-per-node 2 examples/own_model.py`)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import docs_blocks

ROOT = Path(__file__).resolve().parents[1]


def test_own_model_example_plans_predicts_and_learns():
    """What `torchrun --nproc-per-node 2 examples/own_model.py` prints is the README's checked
    block (test_docs runs it and compares them character for character; it is not run twice):
    that block shows the plan predicted with and without Duplex, and a model that learns."""
    (block,) = [b for b in docs_blocks.blocks(ROOT / "README.md") if b.checked
                and b.command == "torchrun --nproc-per-node 2 examples/own_model.py"]
    assert "SPMD (k=1)" in block.text and "Duplex (k=2)" in block.text  # predict_plan(plan)
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", block.text)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 10, block.text  # it learns


def test_transformers_example_plans_and_learns():
    pytest.importorskip("transformers")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(ROOT / "examples" / "transformers_model.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "key ops tensor parallel" in run.stdout, run.stdout  # plan.describe()
    losses = [float(x) for x in re.findall(r"step \d+: loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 4 and losses[-1] < 0.9 * losses[0], run.stdout  # it learns


def test_the_readme_shows_the_examples_as_they_are():
    # the README shows the user's own model; docs/api.md the whole transformers example
    for page, example in (("README.md", "own_model.py"),
                          ("docs/api.md", "transformers_model.py")):
        shown = (ROOT / page).read_text()
        assert (ROOT / "examples" / example).read_text().rstrip() in shown, (page, example)
