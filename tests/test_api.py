"""The public API on a model defined only here (not in the zoo): hidup.plan, predict_plan, Plan.save
/ load, hidup.parallelize with AdamW and a cosine schedule on 2 and 4 gloo ranks, Duplex on
and off, fixed and searched plans, each against an independent single-device eager PyTorch run;
checkpoints through torch.distributed.checkpoint resharded across plans and world sizes; and the
one-line error for an op with no sharding rule."""
from __future__ import annotations

import copy
import json

import pytest
import torch

import hidup
from tests.conftest import run_ranks
from tests.user_model import CharMLP, Flipped

STEPS, LR, DECAY = 5, 1e-2, 0.1
CLUSTER = "v100-1x4-nvlink"  # planned for V100s, run here on gloo: the plan is what is tested
# where the search's own plan wins (not a fixed strategy) and splits a weight: on 2 ranks a
# memory limit (bytes) that plain data parallelism exceeds, and every op replicated too (99.2 kB
# with Duplex, and on loopback gloo the fastest plan: no communication at all); on 4, one where
# ddp fits but one tensor-parallel op is faster (below 8e4 fsdp's buckets win)
SEARCHED = {2: dict(cluster="cpu-gloo-loopback", memory=8.5e4),
            4: dict(cluster="v100-2x4", memory=9e4)}


class TinyLM(CharMLP):
    """A user's model (tests/user_model.py's, the one hidup.train's tests name on the command
    line): embedding, a pre-norm MLP block, a head, cross-entropy; vocabulary 32 here."""

    def __init__(self):
        super().__init__(vocab=32, dim=16, hidden=64)


def batches(n: int = STEPS, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 32, (8, 6), generator=g), torch.randint(0, 32, (8, 6), generator=g))
            for _ in range(n)]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)


def cosine(optimizer):
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS)


def eager(steps: int = STEPS) -> tuple[list[float], dict]:
    """The same training in plain single-device PyTorch: losses and final weights."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = adamw(model.parameters())
    sched = cosine(opt)
    losses = []
    for b in batches(steps):
        loss = model(*b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def searched_plan(model, world: int, micro_batches: int | None = None):
    """hidup.plan's own searched plan, one that splits a weight."""
    plan = hidup.plan(model, batches()[0], gpus=world, micro_batches=micro_batches,
                      **SEARCHED[world])
    assert plan.strategy.name == "hidup" and any(
        "S(" in str(plan.strategy.home(n.name)) for n in plan.graph.params), plan.describe()
    return plan


def _train_all(rank, world):
    """Every configuration on these ranks: (name, losses, full weights). Ranks other than 0
    build other initial weights: rank 0's must reach them all."""
    out = []
    torch.manual_seed(0 if rank == 0 else 100 + rank)
    model = TinyLM()
    for plan in ("ddp", "fsdp", "megatron", searched_plan(model, world)):
        for k in (1, 2):
            trainer = hidup.parallelize(copy.deepcopy(model), plan, optimizer=adamw,
                                        lr_scheduler=cosine, micro_batches=k)
            losses = [float(trainer.step(*b)) for b in batches()]
            name = plan if isinstance(plan, str) else "searched"
            out.append((f"{name} k={k}", losses, trainer.full_state_dict()))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_own_model_with_adamw_trains_as_on_one_device(world):
    want_losses, want_weights = eager()
    for name, losses, weights in run_ranks(world, _train_all)[0]:
        assert losses == pytest.approx(want_losses, abs=1e-5), name
        for key, value in want_weights.items():
            assert torch.allclose(weights[key], value, atol=1e-5), (name, key)
        loaded = TinyLM()
        loaded.load_state_dict(weights)  # strict: every name of the user's module is there


def _plan_named(how: str, model, world: int):
    """A searched plan, a 2-D one (dp-megatron, fsdp+tp, hsdp: 2 machines; turned-NAME: data
    parallel over each machine's GPUs instead; flat-fsdp: dp-megatron whose second half of ops
    runs fsdp over every rank, its parameters stored sharded over all of them), a 3-D one
    (cube-NAME: 2 machines of 2 blocks), or a fixed strategy's name."""
    if how == "flat-fsdp":
        return _flat_fsdp(model, world)
    if how.startswith("cube-"):
        from hidup.api import Plan
        from hidup.graph.capture import capture
        from hidup.strategy import Mesh, fixed_strategy

        graph = capture(model, batches()[0])
        strategy = fixed_strategy(how.removeprefix("cube-"), graph, world,
                                  Mesh.grid(2, 2, world // 4))
        return Plan.of(graph, strategy, world, 1)
    if how.removeprefix("turned-") in ("dp-megatron", "fsdp+tp", "hsdp"):
        from dataclasses import replace

        from hidup.api import Plan
        from hidup.graph.capture import capture
        from hidup.strategy import Mesh, fixed_strategy
        from tests.conftest import turned

        graph = capture(model, batches()[0])
        strategy = fixed_strategy(how.removeprefix("turned-"), graph, world,
                                  Mesh.grid(2, world // 2))
        return Plan.of(graph, turned(strategy) if how.startswith("turned-") else strategy,
                       world, 1)
    return searched_plan(model, world) if how == "searched" else how


def _flat_fsdp(model, world: int):
    from dataclasses import replace

    from hidup.api import Plan
    from hidup.graph.capture import capture
    from hidup.graph.placement import flat, flat_option
    from hidup.strategy import Mesh, fixed_strategy

    graph = capture(model, batches()[0])
    inside = fixed_strategy("dp-megatron", graph, world, Mesh.grid(2, world // 2))
    every = fixed_strategy("fsdp", graph, world)
    late = {n.name for n in graph.ops[len(graph.ops) // 2:]}
    read = {t for n in late for t in graph.node(n).inputs if graph.node(t).kind == "param"}
    strategy = replace(
        inside, name="flat-fsdp",
        options={n: flat_option(every.options[n]) if n in late else o
                 for n, o in inside.options.items()},
        placements={t: flat(every.placements[t]) if t in read else p
                    for t, p in inside.placements.items()},
        reshard=every.reshard & read)
    return Plan.of(graph, strategy, world, 2)


def _state_bytes(model) -> float:
    """What AdamW's training state takes unsharded: parameter, gradient, two moments (fp32)."""
    return 16.0 * sum(p.numel() for p in model.parameters())


def _fitting_plan(model, world: int):
    """hidup.plan's choice within 80% of the model's unsharded training state."""
    return hidup.plan(model, batches()[0], cluster=CLUSTER, gpus=world,
                      memory=0.8 * _state_bytes(model))


def _train_fitting(rank, world):
    torch.manual_seed(0)
    model = TinyLM()
    trainer = hidup.parallelize(model, _fitting_plan(model, world), optimizer=adamw,
                                lr_scheduler=cosine)
    return [float(trainer.step(*b)) for b in batches()], trainer.full_state_dict()


def test_a_model_whose_state_does_not_fit_unsharded_gets_a_plan_that_fits_and_trains():
    """With a device smaller than the model's unsharded AdamW state, the plan chosen stores
    parameters sharded (each gathered before use), fits as lowered, and trains as on one device
    (4 gloo ranks)."""
    from hidup.planning.memory import peak_memory
    from hidup.program import lower

    model, world = TinyLM(), 4
    plan = _fitting_plan(model, world)
    assert "stored sharded" in plan.describe()
    peak = peak_memory(lower(plan.graph, plan.strategy, world, plan.micro_batches)).peak
    assert peak <= plan.memory < _state_bytes(model)
    ddp = hidup.plan(model, batches()[0], cluster=CLUSTER, gpus=world, strategy="ddp",
                     micro_batches=1)
    assert peak_memory(lower(ddp.graph, ddp.strategy, world, 1)).peak > plan.memory
    want_losses, want_weights = eager()
    losses, weights = run_ranks(world, _train_fitting)[0]
    assert losses == pytest.approx(want_losses, abs=1e-5)
    for key, value in want_weights.items():
        assert torch.allclose(weights[key], value, atol=1e-5), key


def _save_after(rank, world, folder, steps, how):
    torch.manual_seed(0)
    model = TinyLM()
    trainer = hidup.parallelize(model, _plan_named(how, model, world), optimizer=adamw,
                                lr_scheduler=cosine, example_inputs=batches()[0])
    losses = [float(trainer.step(*b)) for b in batches()[:steps]]
    trainer.save_checkpoint(folder)
    return losses


def _resume(rank, world, folder, steps, how):
    model = TinyLM()  # other initial weights: all of them must come from the checkpoint
    trainer = hidup.parallelize(model, _plan_named(how, model, world), optimizer=adamw,
                                lr_scheduler=cosine, example_inputs=batches()[0])
    trainer.load_checkpoint(folder)
    return [float(trainer.step(*b)) for b in batches()[steps:]], trainer.full_state_dict()


@pytest.mark.parametrize("saved, world_saved, resumed, world_resumed", [
    ("ddp", 2, "megatron", 4), ("megatron", 2, "searched", 4), ("searched", 4, "ddp", 2),
    ("dp-megatron", 4, "megatron", 2), ("ddp", 2, "dp-megatron", 4), ("fsdp", 2, "megatron", 4),
    ("fsdp+tp", 4, "ddp", 2), ("fsdp", 2, "fsdp+tp", 4), ("turned-fsdp+tp", 4, "fsdp+tp", 4),
    ("fsdp", 2, "turned-fsdp+tp", 4), ("flat-fsdp", 4, "megatron", 2),
    ("fsdp", 2, "flat-fsdp", 4), ("hsdp", 4, "fsdp", 2), ("cube-hsdp+tp", 8, "fsdp", 2),
    ("fsdp", 2, "cube-fsdp+tp", 8)])
def test_checkpoint_resumes_under_another_plan_and_world_size(tmp_path, saved, world_saved,
                                                              resumed, world_resumed):
    want_losses, want_weights = eager()
    before = run_ranks(world_saved, _save_after, str(tmp_path), 3, saved)[0]
    after, weights = run_ranks(world_resumed, _resume, str(tmp_path), 3, resumed)[0]
    assert before + after == pytest.approx(want_losses, abs=1e-5)
    for key, value in want_weights.items():
        assert torch.allclose(weights[key], value, atol=1e-5), key


def test_plan_predicts_saves_and_loads(tmp_path):
    from simulator.predict import predict_plan

    model = TinyLM()
    plan = hidup.plan(model, batches()[0], cluster=CLUSTER, gpus=4, micro_batches=2)
    prediction = predict_plan(plan)
    assert prediction.spmd.step_time > 0 and prediction.duplex.step_time > 0
    assert "SPMD (k=1)" in str(prediction)
    plan.save(tmp_path / "plan.json")
    again = hidup.Plan.load(tmp_path / "plan.json", TinyLM())
    assert again.strategy.options == plan.strategy.options
    assert again.micro_batches == plan.micro_batches and again.gpus == 4
    assert predict_plan(again).duplex.step_time == pytest.approx(prediction.duplex.step_time)
    with pytest.raises(ValueError, match="loaded without its model"):
        predict_plan(hidup.Plan.load(tmp_path / "plan.json"))
    with pytest.raises(ValueError, match="for 4 ranks, this run has 1"):
        hidup.parallelize(TinyLM(), again, optimizer=adamw)


def test_a_plan_of_one_sequence_per_gpu_is_predicted_without_duplex():
    """4 sequences on 4 GPUs under ddp: one per rank, which does not split into micro-batches;
    predict_plan simulates the plan as plain SPMD and says why there is no Duplex, instead of
    failing to lower 2 micro-batches."""
    from simulator.predict import predict_plan

    ids = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(0))
    plan = hidup.plan(TinyLM(), (ids, ids.clone()), cluster=CLUSTER, gpus=4, strategy="ddp")
    assert plan.micro_batches == 1
    prediction = predict_plan(plan)
    assert prediction.k == 1 and prediction.spmd.step_time > 0
    text = str(prediction)
    assert "no Duplex with 2 micro-batches: " in text and "does not split into 4 ranks" in text
    assert "SPMD (k=1)" in text and "Duplex (k=" not in text and "speedup" not in text


def test_an_op_without_an_overlay_rule_plans_from_dtensor():
    """flip has no rule of HiDup's own: DTensor's strategy covers it, nothing is refused or
    replicated."""
    plan = hidup.plan(Flipped(), batches()[0], cluster=CLUSTER, gpus=2, strategy="ddp")
    assert "flip" in {n.op.split(".")[1] for n in plan.graph.ops}
    assert "covered by no rule" not in plan.describe(), plan.describe()


def test_world_one_equals_eager_and_state_round_trips():
    want_losses, want_weights = eager()
    torch.manual_seed(0)
    model = TinyLM()
    trainer = hidup.parallelize(model, hidup.plan(model, batches()[0], cluster=CLUSTER, gpus=1),
                                optimizer=adamw, lr_scheduler=cosine)
    trainer.state_dict()  # before any step: it must change nothing
    losses = [float(trainer.step(*b)) for b in batches()[:3]]
    state = trainer.state_dict()
    torch.manual_seed(5)
    other = hidup.parallelize(TinyLM(), "ddp", optimizer=adamw, lr_scheduler=cosine,
                              example_inputs=batches()[0])
    other.load_state_dict(state)
    assert other.steps == 3 and other.lr_scheduler.last_epoch == 3
    losses += [float(other.step(*b)) for b in batches()[3:]]  # the restored optimizer goes on
    assert losses == pytest.approx(want_losses, abs=1e-5)
    full = other.full_state_dict()
    for key, value in want_weights.items():
        assert torch.allclose(full[key], value, atol=1e-5), key


def test_frozen_parameters_stay_as_in_eager():
    torch.manual_seed(0)
    model = TinyLM()
    model.norm.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = adamw([p for p in ref.parameters() if p.requires_grad])
    trainer = hidup.parallelize(model, "ddp", optimizer=adamw)
    for b in batches():
        ref(*b).backward()
        opt.step()
        opt.zero_grad()
        trainer.step(*b)
    full = trainer.full_state_dict()
    for key, value in ref.state_dict().items():
        assert torch.allclose(full[key], value, atol=1e-5), key
    assert torch.equal(full["norm.weight"], torch.ones(16))


def test_what_the_trainer_cannot_do_is_one_line_and_tied_weights_train():
    from hidup.strategy import fixed_strategy
    from hidup.runtime import trainer as trainer_module

    class Tied(TinyLM):
        def __init__(self):
            super().__init__()
            self.head.weight = self.emb.weight

    tied = hidup.parallelize(Tied(), "ddp", optimizer=adamw, example_inputs=batches()[0])
    tied.step(*batches()[0])  # tied weights train as one tensor: both names hold its value
    state = tied.full_state_dict()
    assert torch.equal(state["emb.weight"], state["head.weight"])
    trainer = hidup.parallelize(TinyLM(), "ddp", optimizer=adamw, example_inputs=batches()[0])
    short = tuple(x[:7] for x in batches()[0])
    with pytest.raises(ValueError, match=r"planned for: tokens int64\[8,6\], targets int64\[8,6\]; "
                                         r"got int64\[7,6\], int64\[7,6\]"):
        trainer.step(*short)
    graph = trainer.graph
    megatron = fixed_strategy("megatron", graph, 2)
    with pytest.raises(ValueError, match=r"^optimizer Adafactor does not update element by element"):
        trainer_module._check_optimizer(torch.optim.Adafactor([torch.zeros(2)]), megatron, graph,
                                        None)


def test_a_plan_file_from_the_command_keeps_its_micro_batches(tmp_path, capsys):
    from hidup import planner as plan_command

    out = tmp_path / "plan.json"
    assert plan_command.main(["--model", "bert-sgmoe:paper", "--cluster", "v100-2x4", "--gpus",
                              "8", "--optimizer", "sgd", "--micro-batches", "2", "--out", str(out),
                              "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["chosen_k"] == 2  # Duplex asked for: the file must say so
    loaded = hidup.Plan.load(out)
    assert loaded.micro_batches == 2 and loaded.optimizer == "sgd" and loaded.gpus == 8


def test_a_checkpoint_failure_is_the_ranks_own_error(tmp_path, monkeypatch):
    """torch.distributed.checkpoint wraps each rank's failure in a BaseException no `except
    Exception` catches (hidup.train's lost-peer handler among them): the first one is raised."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def lost(*args, **kwargs):
        raise CheckpointException("save failed", {1: (RuntimeError("[gloo] Connection closed by "
                                                                   "peer"), None)})

    trainer = hidup.parallelize(TinyLM(), "ddp", optimizer=adamw, example_inputs=batches()[0])
    monkeypatch.setattr(dcp, "save", lost)
    with pytest.raises(RuntimeError, match=r"^\[gloo\] Connection closed by peer$"):
        trainer.save_checkpoint(tmp_path / "ck")
