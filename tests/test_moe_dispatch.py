"""experiments.moe_dispatch: the Partial variant of expert carries the routers' sums on before
reducing them, and the traffic it reports counts the all-to-alls routed experts run inside
their op."""
import pytest
import torch

pytest.importorskip("transformers")
from experiments.moe_dispatch import gathered, main, traffic  # noqa: E402
from experiments.third_party import build, model_spec  # noqa: E402
from hidup.graph.capture import capture  # noqa: E402
from hidup.graph.placement import P  # noqa: E402
from hidup.program import lower  # noqa: E402
from hidup.program.tasks import Compute  # noqa: E402
from hidup.strategy import fixed_strategy  # noqa: E402


def test_expert_by_all_to_all_and_with_every_row_gathered():
    model = build("qwen2_moe")
    graph = capture(model, model_spec("qwen2_moe").batch(8, torch.Generator().manual_seed(0)))
    expert = fixed_strategy("expert", graph, 2)
    partial = gathered(graph, expert)
    routers = [n for n in graph.ops if n.op == "hidup.tokens"]
    assert all(str(partial.options[n.name]) == "(R, R, R, S(0), S(0)) -> P(sum)" for n in routers)
    # the sum over each token's experts (a view, then a sum) takes the Partial on: each layer's
    # router output is reduced after it, not on its rows per (token, expert)
    carried = [n for n in graph.ops if n.op != "hidup.tokens" and n.op != "aten.cross_entropy_loss"
               ".default" and partial.options[n.name].output == P]
    assert any(n.op == "aten.sum.dim_IntList" for n in carried), carried
    program = lower(graph, expert, 2, 1, optimizer="sgd")
    sent, reduced = traffic(program), traffic(lower(graph, partial, 2, 1, optimizer="sgd"))
    # 2 routers of 2 grouped matmuls, each 3 all-to-alls forward (counts, rows, products) and 4
    # backward (counts, rows, their gradients, the rows' gradients back)
    inner = [kind for t in program.tasks if isinstance(t, Compute) for kind, _ in t.inner]
    assert inner == ["all_to_all"] * (2 * 2 * (3 + 4))
    assert sent["all_to_all"] > 0 and "reduce_scatter" not in sent
    assert reduced["all_gather"] > 0 and reduced["reduce_scatter"] > 0 and not reduced["all_to_all"]


def test_bad_counts_are_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--real", "qwen2_moe", "--steps", "0"])
    assert "give at least 2 sequences (one per rank) and 1 step" in capsys.readouterr().err
