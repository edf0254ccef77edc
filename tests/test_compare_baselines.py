"""experiments.compare_baselines prints its table as the Markdown block docs/paper_evaluation.md
holds (a hand-made row: the speedups are over the best baseline, k = 1 and k = 2)."""
from __future__ import annotations

from experiments.compare_baselines import NAMES, table


def test_the_table_is_markdown_with_the_speedups_over_the_best_baseline():
    row = {"model": "bert-sgmoe:paper", "gpus": 16, "hidup_ms": 100.0, "dp_estimate_ms": 110.0,
           "chosen": "search#0 k=2", "ddp": {"k1_ms": 400.0, "k2_ms": 300.0},
           "megatron": {"k1_ms": 250.0, "k2_ms": 200.0}, "expert": {"k1_ms": None, "k2_ms": None}}
    lines = table([row])
    assert lines[0].count("|") == lines[1].count("|") == len(NAMES) + 8
    assert lines[2] == ("| bert-sgmoe:paper | 16 | 100.0 | 400.0 | 250.0 | - | - | - | - "
                        "| 2.50× | 2.00× | +10.0% | search#0 k=2 |")
    assert lines[3] == "" and lines[4].startswith("times: simulated step (ms)")
