"""Fixed strategies and plan files."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from hidup.graph.capture import capture
from hidup.graph.placement import R, Shard
from hidup.models import get_model
from hidup.planning.memory import peak_memory
from hidup.planning.planfile import PlanError, load_plan, save_plan
from hidup.program import lower
from hidup.program.tasks import Compute, Convert
from hidup.strategy import data_parallel, fixed_strategy, megatron
from hidup.strategy.sequence import megatron_sp


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


def test_sequence_parallelism_splits_the_stretches_between_regions(tiny_graphs):
    """megatron-sp: the embedding split by vocabulary, Megatron's regions as in megatron, and
    the ops between them (layer norms, residual adds) split on the sequence (dim 1): entered by
    a reduce-scatter of a region's Partial output, left by an all-gather into the next region's
    column-parallel linear; no activation is all-reduced in the forward."""
    _, _, graph = tiny_graphs["gpt:tiny"]
    s = fixed_strategy("megatron-sp", graph, 2)
    tp = megatron(graph, 2)
    assert s.home("p_tok_weight") == Shard(0)
    assert str(s.options["embedding"]) == "(S(0), R) -> P(sum)"
    assert str(s.options["scaled_dot_product_attention"]) == "(S(1), S(1), S(1)) -> S(1)"
    for op in ("linear", "linear_3", "linear_5"):  # the regions are Megatron's
        assert s.options[op] == tp.options[op], op
    norms = [n.name for n in graph.ops if n.op == "aten.layer_norm.default"]
    adds = [n.name for n in graph.ops if n.op == "aten.add.Tensor"]
    assert norms and all(s.options[n].output == Shard(1) for n in norms + adds)
    forward = [t for t in lower(graph, s, 2, k=1).tasks
               if isinstance(t, Convert) and t.phase == "fwd" and t.collective]
    kinds = Counter(t.kind for t in forward)
    assert kinds["reduce_scatter"] >= 3 and kinds["all_gather"] >= 3, kinds
    assert not [t for t in forward if t.kind == "all_reduce"
                and graph.node(t.tensor).out.shape[-1:] == (32,)], kinds  # none hidden-wide
    # the loss reads the logits split by vocabulary (never gathered), all-reducing each row's
    # maximum and sum of exponentials inside itself: two float32 per row of the batch
    assert str(s.options["cross_entropy_loss"]) == "(S(1), R) -> P(sum)"
    logits = graph.node("cross_entropy_loss").inputs[0]
    assert not [t for t in forward if graph.node(t.tensor).name == logits]
    loss = next(t for t in lower(graph, s, 2, k=1).tasks if isinstance(t, Compute)
                and t.node == "cross_entropy_loss" and t.phase == "fwd")
    rows = graph.node(graph.node("cross_entropy_loss").inputs[1]).out.numel
    assert loss.inner == (("all_reduce", 4 * rows),) * 2


def test_sequence_parallelism_holds_less_than_megatron():
    """Between the regions each rank holds a piece of the sequence: llama:tiny's activations
    under megatron-sp are below those of the same regions with the stretches between them whole,
    and its weights are split alike."""
    spec = get_model("llama:tiny", gpus=2)
    graph = capture(spec.build(), spec.inputs(spec.batch, torch.Generator().manual_seed(0)))
    sp, whole = megatron_sp(graph, 2), megatron_sp(graph, 2, sequence=False)
    assert sp.placements == whole.placements and sp.options != whole.options
    held, held_whole = (peak_memory(lower(graph, s, 2, k=1)) for s in (sp, whole))
    assert held.params == held_whole.params
    assert held.activations_peak < 0.9 * held_whole.activations_peak, (held, held_whole)
