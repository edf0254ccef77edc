"""Plans and their files: a Plan (what hidup.plan returns and hidup.parallelize runs), a strategy
saved as versioned JSON with the model's fingerprint, world size, mesh and cluster, refused with a
clear message for another model, size or format version; and `resolve_strategy`, which reads a
command's --strategy (a fixed strategy's name or a plan file)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hidup.graph.capture import Graph, TensorMeta, capture
from hidup.graph.dtypes import PRECISIONS
from hidup.graph.ops import node_options
from hidup.graph.placement import Partial, parse_option, parse_placement, plain_option
from hidup.strategy import Mesh, Strategy, describe, fixed_strategy, layers

PLAN_FORMAT, PLAN_VERSION = "hidup-plan", 2  # 2: a named mesh and its "dp" axes


class PlanError(ValueError):
    """A plan file cannot be used for this model or world size."""


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
    precision: str = "fp32"  # the dtypes it was planned at: "fp32", or "bf16" (autocast, float32
    #   master weights): hidup.parallelize runs it under bf16 autocast unless told otherwise

    def describe(self) -> str:
        """The plan in one line: what its ops do, and Duplex or not."""
        duplex = f"Duplex with {self.micro_batches} micro-batches" if self.micro_batches > 1 \
            else "no Duplex"
        what = describe(self.graph, self.strategy) if self.graph is not None else \
            f"strategy {self.strategy.name}"
        return f"{what}; {duplex}"

    @property
    def batch(self) -> int:
        """The global batch size: the first input's first dimension."""
        return self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else 1

    def save(self, path: str | Path) -> None:
        """Write the plan file (as `python -m hidup.planner --out` does: hidup.train reads it)."""
        save_plan(Path(path), self.graph, self.strategy, self.gpus, self.model, self.cluster,
                  micro_batches=self.micro_batches, inputs=self.inputs,
                  fingerprint=self.fingerprint, optimizer=self.optimizer, memory=self.memory,
                  precision=self.precision)

    @classmethod
    def load(cls, path: str | Path, model: torch.nn.Module | None = None) -> Plan:
        """Read a plan file. With `model`, it is captured at the plan's input shapes and checked
        against the plan (so that simulator.predict.predict_plan can simulate it); without, the
        check waits for `parallelize`."""
        path = Path(path)
        doc = read_plan(path)
        if not doc.get("inputs") or not doc.get("fingerprint") or not doc.get("world"):
            raise PlanError(f"plan file {path} does not record the inputs it was made for; "
                            f"make it again with hidup.plan(...).save() or python -m "
                            f"hidup.planner --out")
        inputs = tuple(TensorMeta(tuple(i["shape"]), i["dtype"]) for i in doc["inputs"])
        graph = None if model is None else capture(model, example_inputs(inputs))
        strategy = load_plan(path, graph, doc["world"], doc=doc)
        return cls(strategy, doc["world"], int(doc.get("micro_batches") or 1),
                   doc.get("cluster"), inputs, doc["fingerprint"], doc.get("model") or "model",
                   doc.get("optimizer") or "adamw", graph, doc.get("memory"),
                   _precision(path, doc))

    @classmethod
    def of(cls, graph: Graph, strategy: Strategy, gpus: int, micro_batches: int,
           cluster: str | None = None, model: str = "model", optimizer: str = "adamw",
           memory: float | None = None, precision: str = "fp32") -> Plan:
        """The plan that runs `strategy` for a captured graph (its inputs and fingerprint)."""
        return cls(strategy, gpus, micro_batches, cluster, tuple(n.out for n in graph.user_inputs),
                   graph.fingerprint, model, optimizer, graph, memory, precision)


def example_inputs(metas: tuple[TensorMeta, ...]) -> tuple[torch.Tensor, ...]:
    """Zeros of the recorded shapes and dtypes: a capture depends on shapes only."""
    return tuple(torch.zeros(m.shape, dtype=getattr(torch, m.dtype)) for m in metas)


def resolve_strategy(arg: str, graph: Graph, world: int, cluster: str | None = None,
                     mesh: Mesh | None = None) -> Strategy:
    """A fixed strategy by name (those of a 2-D `mesh` on it), or the plan file at a path
    (noted if searched for another cluster than `cluster`)."""
    path = Path(arg)
    if path.is_file():
        return load_plan(path, graph, world, cluster)
    if path.suffix == ".json" or "/" in arg:
        raise PlanError(f"plan file {arg} does not exist; give an existing plan file or a "
                        f"strategy name such as megatron")
    return fixed_strategy(arg, graph, world, mesh)


def check(graph: Graph, strategy: Strategy) -> None:
    """Every op's option is one its rule offers (over a machine's ranks, or flat: over every
    rank), and no parameter or input is Partial."""
    for node in graph.ops:
        opt = strategy.options.get(node.name)
        if opt is None or plain_option(opt) not in node_options(graph, node):
            raise PlanError(f"node {node.name} ({node.op}): option {opt} is not one of its options")
    for name, p in strategy.placements.items():
        if isinstance(p, Partial):
            raise PlanError(f"{name}: parameters and inputs cannot be Partial")
    unknown = sorted((strategy.recompute | strategy.selective) - set(layers(graph)))
    if unknown:
        raise PlanError(f"recompute: {', '.join(unknown[:3])} is not a layer of this model "
                        f"(its layers: {', '.join(layers(graph)[:4]) or 'none'}); make the plan "
                        f"for this model")


def save_plan(path: Path, graph: Graph | None, strategy: Strategy, world: int, model: str,
              cluster: str | None = None, micro_batches: int | None = None,
              inputs=None, fingerprint: str | None = None, optimizer: str | None = None,
              memory: float | None = None, precision: str = "fp32") -> None:
    """Write the plan file: the strategy, and the model (its fingerprint and the shapes of the
    global batch), world size and cluster it is for; where known, the micro-batches and the
    optimizer it was planned with. Without `graph`, `fingerprint` and `inputs` must be given."""
    if graph is not None:
        fingerprint = graph.fingerprint
        inputs = inputs or tuple(n.out for n in graph.user_inputs)
    doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "model": model,
           "fingerprint": fingerprint, "world": world,
           "mesh": list(strategy.mesh.shape) if strategy.mesh else [world],
           "axes": list(strategy.mesh.names) if strategy.mesh else ["gpus"],
           "dp": list(strategy.dp), "cluster": cluster,
           "micro_batches": micro_batches, "optimizer": optimizer, "memory": memory,
           "precision": precision,
           "inputs": [{"shape": list(m.shape), "dtype": m.dtype} for m in inputs or ()],
           "strategy": strategy.name,
           "placements": {n: str(p) for n, p in strategy.placements.items()},
           "options": {n: str(o) for n, o in strategy.options.items()},
           "reshard": sorted(strategy.reshard), "across": dict(strategy.across),
           "across_axes": list(strategy.across_axes),
           "recompute": sorted(strategy.recompute), "selective": sorted(strategy.selective)}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def read_plan(path: Path) -> dict:
    """A plan file's document, refused in one line if it cannot be read or is not a HiDup plan of
    this format version."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"plan file {path}: cannot read it ({exc}); make it again with "
                        f"python -m hidup.planner --out") from exc
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise PlanError(f"plan file {path}: not a HiDup plan (no \"format\": \"{PLAN_FORMAT}\"); "
                        f"give a file written by python -m hidup.planner --out")
    if doc.get("version") != PLAN_VERSION:
        raise PlanError(f"plan file {path}: version {doc.get('version')}, this HiDup reads version "
                        f"{PLAN_VERSION}; re-create the plan")
    return doc


def _precision(path: Path, doc: dict) -> str:
    """The precision a plan file records (files before it was recorded: fp32)."""
    precision = doc.get("precision") or "fp32"
    if precision not in PRECISIONS:
        raise PlanError(f"plan file {path}: precision {precision!r}; a plan is made for one of "
                        f"{', '.join(PRECISIONS)}")
    return precision


def load_plan(path: Path, graph: Graph | None, world: int, cluster: str | None = None,
              doc: dict | None = None) -> Strategy:
    """Read a plan file (or take its `doc`, from read_plan); refuse it, saying why, for another
    world size, model or format version. A plan searched for another cluster than `cluster` is
    taken, with a note saying so. Without `graph` the model is not checked (hidup.Plan.load:
    parallelize checks it)."""
    doc = doc if doc is not None else read_plan(path)
    if doc.get("world") != world:
        raise PlanError(f"plan file {path} was made for {doc.get('world')} GPUs, this run has "
                        f"{world}; give --gpus {doc.get('world')} or make a plan for {world} "
                        f"GPUs with python -m hidup.planner --gpus {world} --out PLAN.json")
    if graph is not None and doc.get("fingerprint") != graph.fingerprint:
        raise PlanError(f"plan file {path} was made for model {doc.get('model')!r} with fingerprint "
                        f"{doc.get('fingerprint')}, but this model's fingerprint is "
                        f"{graph.fingerprint}; make a plan for this model (and batch size)")
    mesh, dp = _mesh(path, doc, world)
    made_for = doc.get("cluster")
    notes = ()
    if cluster is not None and made_for != cluster:
        notes = (f"plan {Path(path).name} was searched for cluster "
                 f"{made_for or '(not recorded)'}, not {cluster}: re-plan for {cluster} with "
                 f"python -m hidup.planner --cluster {cluster} to get its best plan",)
    strategy = Strategy(doc.get("strategy", Path(path).stem),
                        {n: parse_placement(p) for n, p in doc["placements"].items()},
                        {n: parse_option(o) for n, o in doc["options"].items()}, notes, mesh, dp,
                        frozenset(doc.get("reshard", ())), _across(path, doc),
                        frozenset(doc.get("recompute", ())),
                        frozenset(doc.get("selective", ())),
                        across_axes=_across_axes(path, doc, dp))
    if graph is not None:
        check(graph, strategy)
    return strategy


def _across(path, doc: dict) -> dict[str, int]:
    """The plan's parameters stored sharded across the machines: {name: dim}."""
    across = doc.get("across", {})
    if not (isinstance(across, dict) and all(isinstance(d, int) and not isinstance(d, bool)
                                             and d >= 0 for d in across.values())):
        raise PlanError(f"plan file {path}: \"across\" {across!r} is not {{parameter: dim}}; "
                        f"make the plan again with python -m hidup.planner --out")
    return across


def _across_axes(path, doc: dict, dp: tuple[str, ...]) -> tuple[str, ...]:
    """The dp axes the plan stores its `across` parameters sharded over (files before they were
    recorded: every dp axis)."""
    axes = doc.get("across_axes", list(dp) if doc.get("across") else [])
    if not (isinstance(axes, list) and all(isinstance(a, str) for a in axes)):
        raise PlanError(f"plan file {path}: \"across_axes\" {axes!r} is not a list of axes; "
                        f"make the plan again with python -m hidup.planner --out")
    return tuple(axes)


def _mesh(path, doc: dict, world: int) -> tuple[Mesh | None, tuple[str, ...]]:
    """The plan's mesh and data-parallel axes: its mesh [world] (1-D: none), [MACHINES,
    GPUS_PER_MACHINE] or [MACHINES, BLOCKS, GPUS_PER_BLOCK] with its axes' names and those it
    is data parallel over (one axis' name, in files before they were lists)."""
    mesh, dp = doc.get("mesh", [world]), doc.get("dp") or []
    dp = [dp] if isinstance(dp, str) else dp
    try:
        if not (isinstance(mesh, list) and len(mesh) in (1, 2, 3) and
                all(isinstance(n, int) and n > 0 for n in mesh) and math.prod(mesh) == world):
            raise ValueError(f"mesh {mesh!r} is not [{world}], [MACHINES, GPUS_PER_MACHINE] or "
                             f"[MACHINES, BLOCKS, GPUS_PER_BLOCK] of {world} GPUs")
        names = ("gpus",) if len(mesh) == 1 else Mesh.grid(*mesh).names
        axes = doc.get("axes", list(names))
        if axes != list(names):  # the names the plans' axes go by
            raise ValueError(f"axes {axes!r} are not {list(names)}")
        if not isinstance(dp, list) or not all(isinstance(a, str) for a in dp):
            raise ValueError(f"dp {dp!r} is not a list of axes")
        if len(mesh) == 1:
            if dp:
                raise ValueError(f"dp {dp!r} on a 1-D mesh")
            return None, ()
        grid = Mesh.grid(*mesh)
        Strategy("check", {}, {}, mesh=grid, dp=tuple(dp))  # every axis but one, of 2+ ranks
        return grid, tuple(dp)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"plan file {path}: {exc}; make the plan again with python -m "
                        f"hidup.planner --out") from exc
