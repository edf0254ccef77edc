"""Plan files: a strategy saved as versioned JSON with the model's fingerprint, world size, mesh
and cluster, refused with a clear message for another model, size or format version; and
`resolve_strategy`, which reads a command's --strategy (a fixed strategy's name or a plan file)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from hidup.graph.capture import Graph
from hidup.graph.ops import node_options
from hidup.graph.placement import Partial, parse_option, parse_placement
from hidup.strategy import Strategy, fixed_strategy

PLAN_FORMAT, PLAN_VERSION = "hidup-plan", 1


class PlanError(ValueError):
    """A plan file cannot be used for this model or world size."""


def resolve_strategy(arg: str, graph: Graph, world: int, cluster: str | None = None
                     ) -> Strategy:
    """A fixed strategy by name, or the plan file at a path (noted if searched for another
    cluster than `cluster`)."""
    path = Path(arg)
    if path.is_file():
        return load_plan(path, graph, world, cluster)
    if path.suffix == ".json" or "/" in arg:
        raise PlanError(f"plan file {arg} does not exist; give an existing plan file or a "
                        f"strategy name such as megatron")
    return fixed_strategy(arg, graph, world)


def check(graph: Graph, strategy: Strategy) -> None:
    """Every op's option is one its rule offers, and no parameter or input is Partial."""
    for node in graph.ops:
        opt = strategy.options.get(node.name)
        if opt is None or opt not in node_options(graph, node):
            raise PlanError(f"node {node.name} ({node.op}): option {opt} is not one of its options")
    for name, p in strategy.placements.items():
        if isinstance(p, Partial):
            raise PlanError(f"{name}: parameters and inputs cannot be Partial")


def save_plan(path: Path, graph: Graph | None, strategy: Strategy, world: int, model: str,
              cluster: str | None = None, micro_batches: int | None = None,
              inputs=None, fingerprint: str | None = None, optimizer: str | None = None,
              memory: float | None = None) -> None:
    """Write the plan file: the strategy, and the model (its fingerprint and the shapes of the
    global batch), world size and cluster it is for; where known, the micro-batches and the
    optimizer it was planned with. Without `graph`, `fingerprint` and `inputs` must be given."""
    if graph is not None:
        fingerprint = graph.fingerprint
        inputs = inputs or tuple(n.out for n in graph.user_inputs)
    doc = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "model": model,
           "fingerprint": fingerprint, "world": world,
           "mesh": [strategy.machines, world // strategy.machines] if strategy.machines > 1
           else [world], "cluster": cluster,
           "micro_batches": micro_batches, "optimizer": optimizer, "memory": memory,
           "inputs": [{"shape": list(m.shape), "dtype": m.dtype} for m in inputs or ()],
           "strategy": strategy.name,
           "placements": {n: str(p) for n, p in strategy.placements.items()},
           "options": {n: str(o) for n, o in strategy.options.items()}}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def read_plan(path: Path) -> dict:
    """A plan file's document, refused in one line if it cannot be read or is not a HiDup plan of
    this format version."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PlanError(f"plan file {path}: cannot read it ({exc}); make it again with "
                        f"python -m hidup.plan --out") from exc
    if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
        raise PlanError(f"plan file {path}: not a HiDup plan (no \"format\": \"{PLAN_FORMAT}\"); "
                        f"give a file written by python -m hidup.plan --out")
    if doc.get("version") != PLAN_VERSION:
        raise PlanError(f"plan file {path}: version {doc.get('version')}, this HiDup reads version "
                        f"{PLAN_VERSION}; re-create the plan")
    return doc


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
                        f"GPUs with python -m hidup.plan --gpus {world} --out PLAN.json")
    if graph is not None and doc.get("fingerprint") != graph.fingerprint:
        raise PlanError(f"plan file {path} was made for model {doc.get('model')!r} with fingerprint "
                        f"{doc.get('fingerprint')}, but this model's fingerprint is "
                        f"{graph.fingerprint}; make a plan for this model (and batch size)")
    machines = _machines(path, doc, world)
    made_for = doc.get("cluster")
    notes = ()
    if cluster is not None and made_for != cluster:
        notes = (f"plan {Path(path).name} was searched for cluster "
                 f"{made_for or '(not recorded)'}, not {cluster}: re-plan for {cluster} with "
                 f"python -m hidup.plan --cluster {cluster} to get its best plan",)
    strategy = Strategy(doc.get("strategy", Path(path).stem),
                        {n: parse_placement(p) for n, p in doc["placements"].items()},
                        {n: parse_option(o) for n, o in doc["options"].items()}, notes, machines)
    if graph is not None:
        check(graph, strategy)
    return strategy


def _machines(path, doc: dict, world: int) -> int:
    """The plan's machines: its mesh [world] (1-D) or [machines, ranks per machine] (2-D)."""
    mesh = doc.get("mesh", [world])
    if not (isinstance(mesh, list) and len(mesh) in (1, 2) and all(isinstance(n, int) and n > 0
                                                                    for n in mesh)
            and math.prod(mesh) == world):
        raise PlanError(f"plan file {path}: mesh {mesh!r} is not [{world}] or [MACHINES, "
                        f"GPUS_PER_MACHINE] of {world} GPUs; make the plan again with "
                        f"python -m hidup.plan --out")
    return mesh[0] if len(mesh) == 2 else 1
