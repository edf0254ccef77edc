"""HiDup's Python API: plan your own module for a cluster, and train it.

    plan = hidup.plan(model, example_inputs, cluster="v100-2x4", gpus=8)
    print(plan.describe())
    plan.save("plan.json")                     # hidup.Plan.load("plan.json") reads it back
    trainer = hidup.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    loss = trainer.step(*global_batch)         # under torchrun: every rank gets the same batch

`model(*inputs)` must return the scalar loss. A fixed strategy by name ("ddp", "fsdp",
"megatron", "megatron-sp", "expert") works wherever a Plan does. To simulate a plan step by step (as
simulator.predict prints it): `simulator.predict.predict_plan(plan)`. The plan is chosen by
hidup.planning.select, as the commands choose it; the Trainer is in hidup.runtime.trainer."""
from __future__ import annotations

from pathlib import Path

import torch

from hidup.graph import ops  # noqa: F401  (registers the project's own op rules)
from hidup.graph.capture import capture
from hidup.planning.planfile import Plan
from hidup.planning.profile_file import load_profile
from hidup.planning.select import SEARCH, Goal, select_plan
from hidup.runtime.trainer import Trainer, parallelize

__all__ = ["Plan", "plan", "parallelize", "Trainer"]


def plan(model: torch.nn.Module, example_inputs: tuple | list, *, cluster: str, gpus: int,
         micro_batches: int | None = None, memory: float | None = None,
         optimizer: str = "adamw", strategy: str = SEARCH, mesh: tuple[int, ...] | None = None,
         name: str | None = None, recompute: str = "auto", mode: str = "graph",
         precision: str | None = None) -> Plan:
    """Plan `model` (whose `model(*example_inputs)` returns the loss; the inputs are one global
    batch) for `gpus` ranks of `cluster` (a shipped profile's name or a profile file).

    strategy "search" (default) runs HiDup's Duplex-aware search on the cluster's mesh (`mesh`:
    machines x GPUs per machine, or machines x blocks x GPUs per block, to choose another)
    within `memory` bytes per device (default: the profile's device memory), with the fixed
    strategies as baselines, and keeps the fastest plan that fits; "ddp", "fsdp", "megatron",
    "megatron-sp" or "expert" takes that fixed strategy, and on a mesh of 2 or more machines
    "hsdp", "dp-megatron", "dp-expert", "fsdp+tp" and "tp+ep" (on a 3-D one also "hsdp+tp")
    too.
    micro_batches None lets the planner choose between plain SPMD and Duplex (k=2); a number fixes it. `optimizer`
    is the one training will use ("sgd", "adamw", ...: its state counts in memory and its
    update in the step). `recompute` is activation checkpointing: "auto" recomputes the fewest
    first layers that make a plan fit where it does not fit otherwise (selectively: the
    matmuls' and attention's outputs kept; or whole); "none", "all", a count of first layers as
    text ("4") or layer names joined by commas ("layers.0,layers.1"), each also as
    "selective:...". `mode` is how hidup.parallelize will run the step ("graph", "compile",
    "cuda-graphs"): on a profile with host figures its host cost, and for "compile" Inductor's
    fused kernels, rank the plans. `precision` ("fp32" or "bf16": mixed precision under
    torch.autocast, float32 master weights; default: the profile's) sets the dtype each value,
    collective and memory is counted at; train a bf16 plan with autocast=torch.bfloat16. The same
    arguments give the plan `python -m hidup.planner` and `python -m simulator.predict`
    choose."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    profile = load_profile(cluster)
    goal = Goal(gpus, micro_batches, None if memory is None else float(memory), optimizer,
                None if mesh is None else tuple(mesh), strategy, recompute=recompute, mode=mode,
                precision=precision)
    graph = capture(model, tuple(example_inputs))
    chosen = select_plan(graph, profile, goal)
    where = str(cluster) if Path(str(cluster)).is_file() else profile.name
    return Plan.of(graph, chosen.strategy, gpus, chosen.k, where, name or type(model).__name__,
                   optimizer, goal.memory, chosen.goal.precision)
