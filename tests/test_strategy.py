"""Fixed strategies and plan files."""
from __future__ import annotations

import json

import pytest

from hidup.graph.placement import R, Shard
from hidup.planning.planfile import PlanError, load_plan, save_plan
from hidup.strategy import data_parallel, megatron


def test_ddp_splits_batch_and_replicates_parameters(tiny_graphs):
    _, _, graph = tiny_graphs["mlp:tiny"]
    s = data_parallel(graph, 2)
    assert all(s.home(p.name) == R for p in graph.params)
    assert s.home("x") == Shard(0)
    assert str(s.options["linear"]) == "(S(0), R, R) -> S(0)"
    assert str(s.options["mse_loss"]) == "(S(0), S(0)) -> P(sum)"


def test_megatron_alternates_column_and_row_parallel(tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    s = megatron(graph, 2)
    assert str(s.options["linear"]) == "(R, S(0), S(0)) -> S(2)"  # q: column parallel
    assert str(s.options["scaled_dot_product_attention"]) == "(S(1), S(1), S(1)) -> S(1)"  # heads
    assert str(s.options["linear_3"]) == "(S(2), S(1), R) -> P(sum)"  # attention projection: rows
    assert str(s.options["linear_5"]) == "(S(2), S(1), R) -> P(sum)"  # second feed-forward: rows


def test_plan_file_round_trip(tmp_path, tiny_graphs):
    _, _, graph = tiny_graphs["gpt:tiny"]
    s = megatron(graph, 4)
    save_plan(tmp_path / "plan.json", graph, s, 4, "gpt:tiny")
    again = load_plan(tmp_path / "plan.json", graph, 4)
    assert again.options == s.options and again.placements == s.placements


def test_plan_file_refused_for_another_model_or_world(tmp_path, tiny_graphs):
    _, _, mlp = tiny_graphs["mlp:tiny"]
    _, _, lm = tiny_graphs["gpt:tiny"]
    save_plan(tmp_path / "plan.json", lm, megatron(lm, 2), 2, "gpt:tiny")
    with pytest.raises(PlanError, match=r"made for model 'gpt:tiny' with fingerprint "
                                        r"\w+, but this model's fingerprint is \w+"):
        load_plan(tmp_path / "plan.json", mlp, 2)
    with pytest.raises(PlanError, match="made for 2 GPUs, this run has 4; give --gpus 2"):
        load_plan(tmp_path / "plan.json", lm, 4)


def test_plan_file_bad_input(tmp_path, tiny_graphs):
    _, _, graph = tiny_graphs["mlp:tiny"]
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(PlanError, match="cannot read it"):
        load_plan(tmp_path / "junk.json", graph, 2)
    (tmp_path / "other.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(PlanError, match="not a HiDup plan"):
        load_plan(tmp_path / "other.json", graph, 2)
    save_plan(tmp_path / "plan.json", graph, data_parallel(graph, 2), 2, "mlp:tiny")
    doc = json.loads((tmp_path / "plan.json").read_text())
    doc["options"]["linear"] = "(S(1), R, R) -> S(0)"
    (tmp_path / "plan.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=r"node linear \(aten.linear.default\): option .* is not one"):
        load_plan(tmp_path / "plan.json", graph, 2)


def test_expert_keeps_the_loss_a_partial_sum_and_moves_tokens_by_all_to_all():
    """Only the expert einsums are kept from partial sums: the loss's sum over a batch-split
    output stays Partial (as in DDP) instead of gathering the whole output."""
    import collections
    from hidup.models import capture_model, get_model
    from hidup.program import lower
    from hidup.strategy import expert_parallel
    spec = get_model("bert-switch:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    kinds = collections.Counter(c.kind for c in lower(graph, expert_parallel(graph, 2), 2).collectives)
    assert set(kinds) == {"all_to_all", "all_reduce"}
