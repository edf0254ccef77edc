"""The optimizer that runs is in the Program: its update task is costed from hidup.program's
OPTIMIZERS table, its state counts in the peak memory, and the search and python -m hidup.planner see both."""
from __future__ import annotations

import json
import math

import pytest

from hidup.graph.placement import Shard
from hidup.models import capture_model, get_model
from hidup.planner import main as plan_main
from hidup.planning.memory import peak_memory
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.search import search
from hidup.strategy import data_parallel, fixed_strategies, megatron
from hidup.program import OPTIMIZERS, Compute, LoweringError, Program, lower
from conftest import one_line

PROFILE = "v100-1x4-nvlink"


@pytest.fixture(scope="module")
def gpt():
    spec = get_model("gpt:tiny", gpus=2)
    return capture_model(spec, spec.batch)


def local_elements(graph, strategy, world) -> int:
    """A rank's parameter elements: each parameter whole, or 1/world of it where its home
    placement splits it."""
    return sum(n.out.numel // (world if isinstance(strategy.home(n.name), Shard) else 1)
               for n in graph.params)


def update_task(program: Program) -> Compute:
    (task,) = [t for t in program.tasks if isinstance(t, Compute) and t.phase == "update"]
    return task


def test_the_table_has_the_known_optimizers():
    assert {"sgd", "sgd-momentum", "adam", "adamw"} <= set(OPTIMIZERS)
    sgd, adamw = OPTIMIZERS["sgd"], OPTIMIZERS["adamw"]
    assert (sgd.flops, sgd.bytes, sgd.states) == (2, 12, 0)
    assert OPTIMIZERS["sgd-momentum"].states == 1
    assert OPTIMIZERS["adam"].states == adamw.states == 2
    # AdamW does Adam's work plus the decoupled weight decay, and moves at least the 7 fp32
    # tensors a fused kernel would (read p, g, exp_avg, exp_avg_sq; write p and both moments)
    assert adamw.flops > OPTIMIZERS["adam"].flops and adamw.bytes >= 7 * 4
    assert sgd.op == "optimizer.step" and len({o.op for o in OPTIMIZERS.values()}) == len(OPTIMIZERS)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("make", [data_parallel, megatron])
def test_update_task_follows_the_table(gpt, make, name):
    strategy = make(gpt, 2)
    program = lower(gpt, strategy, 2, k=2, optimizer=name)
    cost, numel = OPTIMIZERS[name], local_elements(gpt, strategy, 2)
    task = update_task(program)
    assert program.optimizer == name and task.op == cost.op
    assert (task.flops, task.bytes) == (cost.flops * numel, cost.bytes * numel)


def test_adamw_is_the_default_and_sgd_keeps_its_op_name(gpt):
    """AdamW, what hidup.train runs, is every door's default (the lowering, a Program, the
    search, the selection); sgd's update keeps the op name calibrated profiles know it by."""
    from hidup.planning.programme import SearchOptions
    from hidup.planning.select import Goal

    assert lower(gpt, data_parallel(gpt, 2), 2, k=1).optimizer == "adamw"
    assert Program("none", "", "hand", 1, 1, (), (), {}).optimizer == "adamw"
    assert SearchOptions().optimizer == Goal(2).optimizer == "adamw"
    program = lower(gpt, data_parallel(gpt, 2), 2, k=1, optimizer="sgd")
    numel = local_elements(gpt, data_parallel(gpt, 2), 2)
    task = update_task(program)
    assert (task.op, task.flops, task.bytes) == ("optimizer.step", 2.0 * numel, 12.0 * numel)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("make", [data_parallel, megatron])
def test_adamw_holds_two_fp32_moments_more_than_sgd(gpt, make, k):
    strategy = make(gpt, 2)
    numel = local_elements(gpt, strategy, 2)
    sgd, momentum, adamw = (peak_memory(lower(gpt, strategy, 2, k, optimizer=name))
                            for name in ("sgd", "sgd-momentum", "adamw"))
    assert sgd.optimizer == 0 and momentum.optimizer == 4 * numel
    assert adamw.optimizer == 2 * 4 * numel
    assert adamw.peak - sgd.peak == 2 * 4 * numel
    assert momentum.peak - sgd.peak == 4 * numel
    # the caller's own figure still wins
    explicit = peak_memory(lower(gpt, strategy, 2, k, optimizer="adamw"),
                           optimizer_bytes_per_param=0)
    assert explicit.peak == sgd.peak


def test_unknown_optimizer_is_a_one_line_error(gpt, capsys):
    with pytest.raises(LoweringError) as info:
        lower(gpt, data_parallel(gpt, 2), 2, optimizer="lion")
    message = str(info.value)
    assert "\n" not in message and "'lion'" in message
    assert all(name in message for name in OPTIMIZERS)
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        search(gpt, 2, load_profile(PROFILE), SearchOptions(k=2, optimizer="lion"))
    line = one_line(plan_main, ["--model", "gpt:tiny", "--gpus", "2", "--optimizer", "lion"],
                    capsys, code=2)
    assert "--optimizer" in line and "'lion'" in line and "adamw" in line


def _ddp_peaks(graph, base) -> dict[str, int]:
    """ddp's least peak (k = 1 or 2) with each optimizer."""
    return {name: min(peak_memory(lower(graph, base["ddp"], 2, k, optimizer=name)).peak
                      for k in (1, 2)) for name in ("sgd", "adamw")}


def _ddp_ranked(found) -> bool:
    return any(name.startswith("ddp ") for name, _ in found.candidates)


def test_search_memory_limit_sees_the_optimizer_state():
    """A limit that plain ddp meets with SGD but not with AdamW's moments: the search ranks ddp
    for SGD, and for AdamW avoids it (and megatron) for plans that fit with their moments."""
    spec = get_model("bert-sgmoe:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    profile, base = load_profile(PROFILE), fixed_strategies(graph, 2)
    ddp = _ddp_peaks(graph, base)
    limit = ddp["adamw"] - 1
    assert ddp["sgd"] <= limit
    with_sgd = search(graph, 2, profile, SearchOptions(k=2, memory=limit, optimizer="sgd"), baselines=base)
    assert _ddp_ranked(with_sgd)
    with_adamw = search(graph, 2, profile, SearchOptions(k=2, memory=limit, optimizer="adamw"), baselines=base)
    assert not _ddp_ranked(with_adamw)
    assert with_adamw.strategy.options != base["ddp"].options
    chosen = lower(graph, with_adamw.strategy, 2, with_adamw.k, optimizer="adamw")
    assert chosen.optimizer == "adamw" and peak_memory(chosen).peak <= limit


def test_search_refuses_where_only_sgd_fits_unless_the_state_is_sharded(gpt):
    """The search finds no plan of its own for gpt:tiny that is leaner than ddp: under ddp's
    AdamW peak, with ddp as the only baseline, only SGD fits, unless the search may recompute
    layers (its programme then keeps plans whose activations fit recomputed, and finds one that
    fits).
    fsdp, which keeps parameters, gradients and AdamW's state sharded, fits there with AdamW
    (and megatron, which splits the weights and the activations between them)."""
    profile, every = load_profile(PROFILE), fixed_strategies(gpt, 2)
    base = {"ddp": every["ddp"]}
    limit = _ddp_peaks(gpt, base)["adamw"] - 1
    kept = frozenset()  # no layer recomputed
    assert search(gpt, 2, profile, SearchOptions(k=2, memory=limit, optimizer="sgd"),
                  baselines=base).strategy.options == base["ddp"].options
    with pytest.raises(ValueError, match=r"search: no (plan|option of node \w+ .*) fits in"):
        search(gpt, 2, profile, SearchOptions(k=2, memory=limit, optimizer="adamw",
                                              recompute=kept), baselines=base)
    found = search(gpt, 2, profile, SearchOptions(k=2, memory=limit, optimizer="adamw",
                                                  recompute=kept), baselines=every)
    assert {"fsdp", "megatron"} <= {r.name for r in found.ranked}
    recomputing = search(gpt, 2, profile, SearchOptions(k=2, memory=limit, optimizer="adamw"),
                         baselines=base)
    assert peak_memory(lower(gpt, recomputing.strategy, 2, recomputing.k,
                             optimizer="adamw")).peak <= limit


def test_search_estimate_includes_the_update(gpt):
    """With no limit both searches may choose ddp; AdamW's update is slower than SGD's."""
    profile, base = load_profile(PROFILE), {"ddp": data_parallel(gpt, 2)}
    times = {name: dict(search(gpt, 2, profile, SearchOptions(k=2, optimizer=name), baselines=base).candidates)
             for name in ("sgd", "adamw")}
    for plan in ("ddp k=1", "ddp k=2"):
        assert times["adamw"][plan] > times["sgd"][plan]


def test_plan_cli_prices_the_optimizer(capsys):
    docs = {}
    for name in ("sgd", "adamw"):
        assert plan_main(["--model", "gpt:tiny", "--gpus", "2", "--cluster", PROFILE,
                          "--optimizer", name, "--json"]) == 0
        docs[name] = json.loads(capsys.readouterr().out)
        assert docs[name]["optimizer"] == name
    spec = get_model("gpt:tiny", gpus=2)
    graph = capture_model(spec, spec.batch)
    numel = local_elements(graph, data_parallel(graph, 2), 2)
    for k in ("k1_gib", "k2_gib"):
        sgd, adamw = docs["sgd"]["plans"]["ddp"][k], docs["adamw"]["plans"]["ddp"][k]
        assert math.isclose((adamw - sgd) * 2**30, 2 * 4 * numel, rel_tol=1e-9)
    assert plan_main(["--model", "gpt:tiny", "--gpus", "2", "--cluster", PROFILE]) == 0
    assert "optimizer adamw" in capsys.readouterr().out  # the default, as hidup.train runs
