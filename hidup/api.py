"""HiDup's Python API: plan your own module for a cluster, predict it, and train it.

    plan = hidup.plan(model, example_inputs, cluster="v100-2x4", gpus=8)
    print(plan.predict())                      # as simulator.predict prints it
    plan.save("plan.json")                     # hidup.Plan.load("plan.json") reads it back
    trainer = hidup.parallelize(model, plan, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-4))
    loss = trainer.step(*global_batch)         # under torchrun: every rank gets the same batch

`model(*inputs)` must return the scalar loss. A fixed strategy by name ("ddp", "megatron",
"expert") works wherever a Plan does. The Trainer is in hidup.runtime.trainer."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hidup.graph import ops
from hidup.graph.capture import Graph, TensorMeta, capture
from hidup.planning.costs import load_profile
from hidup.planning.planfile import PlanError, load_plan, read_plan, save_plan
from hidup.strategy import Strategy, describe, fixed_strategy
from hidup.runtime.trainer import FIXED, Trainer, parallelize

__all__ = ["Plan", "plan", "parallelize", "Trainer"]


@dataclass
class Plan:
    """A strategy for one model on `gpus` ranks of a cluster, run with `micro_batches`
    micro-batches per rank (2 or more: Duplex)."""

    strategy: Strategy
    gpus: int
    micro_batches: int
    cluster: str | None
    inputs: tuple[TensorMeta, ...]  # the global batch's shapes and dtypes the plan is for
    fingerprint: str
    model: str = "model"  # a name for reports
    optimizer: str = "adamw"
    graph: Graph | None = field(default=None, repr=False)  # None when loaded from a file
    memory: float | None = None  # the device memory limit it was planned within (bytes), if given

    def describe(self) -> str:
        """The plan in one line: what its ops do, and Duplex or not."""
        duplex = f"Duplex with {self.micro_batches} micro-batches" if self.micro_batches > 1 \
            else "no Duplex"
        what = describe(self.graph, self.strategy) if self.graph is not None else \
            f"strategy {self.strategy.name}"
        return f"{what}; {duplex}"

    def predict(self, cluster: str | None = None, mode: str = "graph"):
        """The plan simulated on `cluster` (default: the one it was made for) as plain SPMD (k=1)
        and with Duplex (its micro-batches, at least 2): a simulator.report.Prediction, whose
        str() is simulator.predict's report and `.spmd` / `.duplex` the simulated steps."""
        from simulator.predict import simulate

        if self.graph is None:
            raise ValueError("this plan was loaded without its model: load it with "
                             "hidup.Plan.load(path, model) to predict it")
        cluster = cluster or self.cluster
        if cluster is None:
            raise ValueError("this plan names no cluster: give predict(cluster=NAME_OR_PROFILE)")
        profile = load_profile(cluster)
        profile.check_world(self.gpus)
        if self.memory is not None:
            profile = replace(profile, device_memory=self.memory)
        return simulate(self.model, profile, _batch(self.inputs), self.graph, self.strategy, self.gpus,
                        max(2, self.micro_batches), mode=mode, optimizer=self.optimizer)

    def save(self, path: str | Path) -> None:
        """Write the plan file (as `python -m hidup.plan --out` does: hidup.train reads it)."""
        save_plan(Path(path), self.graph, self.strategy, self.gpus, self.model, self.cluster,
                  micro_batches=self.micro_batches, inputs=self.inputs,
                  fingerprint=self.fingerprint, optimizer=self.optimizer, memory=self.memory)

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module | None = None) -> Plan:
        """Read a plan file. With `model`, it is captured at the plan's input shapes and checked
        against the plan (so that `predict()` works); without, the check waits for
        `parallelize`."""
        path = Path(path)
        doc = read_plan(path)
        if not doc.get("inputs") or not doc.get("fingerprint") or not doc.get("world"):
            raise PlanError(f"plan file {path} does not record the inputs it was made for; "
                            f"make it again with hidup.plan(...).save() or python -m hidup.plan "
                            f"--out")
        inputs = tuple(TensorMeta(tuple(i["shape"]), i["dtype"]) for i in doc["inputs"])
        graph = None if model is None else capture(model, example_inputs(inputs))
        strategy = load_plan(path, graph, doc["world"], doc=doc)
        return cls(strategy, doc["world"], int(doc.get("micro_batches") or 1),
                   doc.get("cluster"), inputs, doc["fingerprint"], doc.get("model") or "model",
                   doc.get("optimizer") or "adamw", graph, doc.get("memory"))

    @classmethod
    def of(cls, graph: Graph, strategy: Strategy, gpus: int, micro_batches: int,
           cluster: str | None = None, model: str = "model", optimizer: str = "adamw",
           memory: float | None = None) -> Plan:
        """The plan that runs `strategy` for a captured graph (its inputs and fingerprint)."""
        return cls(strategy, gpus, micro_batches, cluster, tuple(n.out for n in graph.user_inputs),
                   graph.fingerprint, model, optimizer, graph, memory)


def _batch(inputs: tuple[TensorMeta, ...]) -> int:
    """The global batch size: the first input's first dimension."""
    return inputs[0].shape[0] if inputs and inputs[0].shape else 1


def example_inputs(metas: tuple[TensorMeta, ...]) -> tuple[torch.Tensor, ...]:
    """Zeros of the recorded shapes and dtypes: a capture depends on shapes only."""
    return tuple(torch.zeros(m.shape, dtype=getattr(torch, m.dtype)) for m in metas)


def plan(model: torch.nn.Module, example_inputs: tuple | list, *, cluster: str, gpus: int,
         micro_batches: int | None = None, memory: float | None = None,
         optimizer: str = "adamw", strategy: str = "search", name: str | None = None) -> Plan:
    """Plan `model` (whose `model(*example_inputs)` returns the loss; the inputs are one global
    batch) for `gpus` ranks of `cluster` (a shipped profile's name or a profile file).

    strategy "search" (default) runs HiDup's Duplex-aware search within `memory` bytes per
    device (default: the profile's device memory) and keeps it unless a fixed strategy is
    predicted faster; "ddp", "megatron" or "expert" takes that fixed strategy. micro_batches
    None lets the prediction choose between plain SPMD and Duplex (k=2); a number fixes it.
    `optimizer` is the one training will use ("sgd", "adamw", ...: its state counts in memory
    and its update in the step)."""
    from simulator.predict import choose

    if strategy != "search" and strategy not in FIXED:
        raise ValueError(f"strategy={strategy!r}: give 'search' or one of {list(FIXED)}")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r}: give the number of ranks, 1 or more")
    if micro_batches is not None and (not isinstance(micro_batches, int) or micro_batches < 1):
        raise ValueError(f"micro_batches={micro_batches!r}: give 1 (plain SPMD), 2 or more "
                         f"(Duplex), or None to let HiDup choose")
    profile = load_profile(cluster)
    profile.check_world(gpus)
    if memory is not None:
        if not memory > 0:
            raise ValueError(f"memory={memory!r}: give a device's memory in bytes, e.g. 16 * 2**30")
        profile = replace(profile, device_memory=float(memory))
    graph = capture(model, example_inputs)
    label = name or type(model).__name__
    if strategy == "search":
        batch = _batch(tuple(n.out for n in graph.user_inputs))
        comparison = choose(label, profile, batch, graph, gpus, micro_batches or 2,
                            optimizer=optimizer)
        chosen, chosen_k = comparison.chosen, comparison.chosen_k
        if micro_batches is not None:  # the fastest run at that k that fits, not the best of two
            run = 0 if micro_batches == 1 else 1
            fitting = [(p.runs()[run][1].step_time, i) for i, p in
                       enumerate(comparison.predictions) if p.fits(p.runs()[run][2])]
            if not fitting:
                raise ValueError(f"no plan with micro_batches={micro_batches} fits a device's "
                                 f"{profile.device_memory / 2**30:.3g} GiB; leave micro_batches "
                                 f"out (None) or give more memory or GPUs")
            chosen, chosen_k = min(fitting)[1], micro_batches
        chosen_strategy = comparison.predictions[chosen].strategy
    else:
        chosen_strategy, chosen_k = fixed_strategy(strategy, graph, gpus), micro_batches or 1
    where = str(cluster) if Path(str(cluster)).is_file() else profile.name
    return Plan.of(graph, chosen_strategy, gpus, chosen_k, where, label, optimizer,
                   None if memory is None else float(memory))
