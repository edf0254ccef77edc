"""The fixed strategies a user would pick instead of a search (data parallel, Megatron tensor
parallel, expert parallel, and on a 2-D mesh the last two inside a machine with data parallel
across), and random valid strategies for tests."""
from __future__ import annotations

import math
from dataclasses import replace

from hidup.graph.capture import Graph, Node
from hidup.graph.flops import GROUPED_MM
from hidup.graph.tokens import TOKENS
from hidup.graph.placement import (R, Partial, Placement, Shard, ShardingOption, flat,
                                   flat_option, is_flat, plain)
from hidup.strategy.base import Strategy, fitting_options, placed, propagate, splits_evenly
from hidup.strategy.mesh import Mesh, axes_words
from hidup.strategy.recompute import layers
from hidup.strategy.sequence import megatron_sp


def data_parallel(graph: Graph, world: int, batch_dim: int = 0) -> Strategy:
    """DDP: user inputs split along the batch, parameters replicated."""
    seeds = {n.name: Shard(batch_dim) for n in graph.user_inputs}
    return propagate(graph, world, "ddp", seeds, shard_params=False)


def megatron(graph: Graph, world: int) -> Strategy:
    """Megatron-LM tensor parallel: inputs replicated; a linear on a replicated input is split by
    columns, one on a column-split input by rows (Partial output, all-reduced where needed)."""
    seeds = {n.name: R for n in graph.user_inputs}
    return propagate(graph, world, "megatron", seeds, shard_params=True,
                     allowed={"all_gather", "all_reduce", "slice"},
                     keep_whole=_reading_no_parameter(graph))


def _reading_no_parameter(graph: Graph) -> set[str]:
    """The ops that read no parameter: under tensor parallelism they split nothing made of whole
    values, as a weight's split is what splits the work (a buffer expanded over the batch and
    sliced there would make the rest of the model data parallel)."""
    return {n.name for n in graph.ops
            if not any(graph.node(t).kind == "param" for t in n.inputs)}




def random_strategy(graph: Graph, world: int, rng, divide: int | None = None) -> Strategy:
    """A random valid strategy (for tests): each op takes a random option whose Partial inputs come
    from Partial producers and whose splits divide by `divide` (default: world); each input is
    placed at random; a parameter goes where its first consumer wants it, and one kept whole
    there is stored sharded or not at random, and each layer recomputed in the backward (whole
    or selectively) or not.
    rng: a random.Random."""
    divide = divide or world
    placements: dict[str, Placement] = {n.name: R for n in graph.nodes if n.kind == "buffer"}
    for n in graph.user_inputs:
        dims = [Shard(d) for d, size in enumerate(n.out.shape) if size > 1]
        placements[n.name] = rng.choice([R] + [p for p in dims
                                               if splits_evenly(graph, n.name, p, divide)])
    choices: dict[str, ShardingOption] = {}
    for node in graph.ops:
        cands = [o for o in fitting_options(graph, node, divide)  # Partial only from Partial
                 if all(not isinstance(want, Partial) or placed(t, placements, choices) == want
                        for t, want in zip(node.inputs, o.inputs))]
        choices[node.name] = rng.choice(cands)
        for t, p in zip(node.inputs, choices[node.name].inputs):
            placements.setdefault(t, p)
    drawn = Strategy("random", {n.name: placements.get(n.name, R) for n in graph.nodes
                                if n.kind != "op"}, choices)
    # where each parameter kept whole lives: whole, or sharded (gathered before use)
    stored = {p.name for p in graph.params if rng.random() < 0.5}
    if stored:
        drawn = sharded_storage(graph, drawn, world, stored, reshard=rng.random() < 0.5)
    # which layers' activations are recomputed in the backward: none, whole, or selectively
    how = {n: rng.choice(("none", "whole", "selective")) for n in layers(graph)}
    return replace(drawn, recompute=frozenset(n for n, h in how.items() if h == "whole"),
                   selective=frozenset(n for n, h in how.items() if h == "selective"))


def expert_parallel(graph: Graph, world: int, batch_dim: int = 0) -> Strategy:
    """DeepSpeed-MoE / FastMoE: data parallel, except the experts, split across ranks (each holds
    experts / world of them), reached with all-to-all and left the same way (no partial sums).
    Expert weights are the 3-d parameters that einsums or grouped matmuls read (experts first),
    themselves or through views, also inside a per-token region (hidup.graph.tokens); a grouped
    matmul's experts give a Partial sum (each rank its experts' rows), all-reduced where it is
    read. The loss's sum
    over the batch stays a partial sum, as in data parallel."""
    seeds: dict[str, Placement] = {n.name: Shard(batch_dim) for n in graph.user_inputs}
    einsums = {n.name for n in graph.ops if n.op == "aten.einsum.default"}
    for node in graph.ops:
        if node.name in einsums or node.op in GROUPED_MM or node.op == TOKENS:
            for t in _expert_inputs(node):
                weight = _through_views(graph, t)
                if weight.kind == "param" and len(weight.out.shape) == 3:
                    seeds[weight.name] = Shard(0)
    experts = [n for n, p in seeds.items()
               if isinstance(p, Shard) and graph.node(n).kind == "param"]
    if not experts:
        raise ValueError("strategy expert: the model has no expert weights (3-d parameters read "
                         "by einsums or grouped matmuls); use ddp")
    count = graph.node(experts[0]).out.shape[0]
    if any(graph.node(n).out.shape[0] % world for n in experts):
        raise ValueError(f"strategy expert on {world} GPUs: the {count} experts do not split "
                         f"over {world} ranks; choose a GPU count that divides {count}")
    return propagate(graph, world, "expert", seeds, shard_params=False, no_partial=einsums)


def _expert_inputs(node: Node) -> tuple[str, ...]:
    """The inputs of an einsum or grouped matmul, or the experts' weights that a per-token
    region's grouped matmuls read (hidup.graph.tokens)."""
    if node.op != TOKENS:
        return node.inputs
    return tuple(t for t, e in zip(node.inputs, node.args[0].experts) if e)


def _through_views(graph: Graph, t: str) -> Node:
    """The tensor that t views (through transposes and views of one input), or t's node."""
    node = graph.node(t)
    while node.kind == "op" and len(node.inputs) == 1 and node.op.split(".")[1] in _VIEWS:
        node = graph.node(node.inputs[0])
    return node


_VIEWS = ("transpose", "permute", "view", "reshape", "t", "contiguous", "_unsafe_view")


def fully_sharded(graph: Graph, world: int, batch_dim: int = 0) -> Strategy:
    """FSDP (ZeRO-3), as torch.distributed.fsdp.fully_shard runs it: every op data parallel as
    in DDP, but each parameter kept sharded (sharded_storage): gathered once per step before its
    first use (an all-gather, whatever the number of micro-batches), its gradient
    reduce-scattered into the shards, the optimizer's state and update on the shards; each
    gathered weight freed after the forward and gathered again for the backward, as fully_shard
    does by default."""
    sharded = sharded_storage(graph, data_parallel(graph, world, batch_dim), world, reshard=True)
    return Strategy("fsdp", sharded.placements, sharded.options, sharded.notes,
                    reshard=sharded.reshard)


def sharded_storage(graph: Graph, strategy: Strategy, world: int,
                    params: set[str] | None = None, reshard: bool = False) -> Strategy:
    """`strategy` with every parameter it keeps whole on a machine's `world` ranks (of
    `params`, where given) stored sharded there instead (dim 0 where it divides by `world`, else its largest dim that does;
    whole where none does, with a note): the ops compute as before, the lowering gathers the
    parameter once per step before its first use and turns its gradient into the shard (a
    reduce-scatter of a partial sum, a slice of a whole one), and the optimizer's state and
    update are on the shard. With `reshard`, each such gathered weight is freed after its last
    use in the forward and gathered again for the backward (FSDP's reshard_after_forward: less
    memory, one more all-gather). The same strategy where nothing changes."""
    homes, whole, changed = dict(strategy.placements), [], False
    for param in graph.params:
        home = homes.get(param.name, R)
        if plain(home) != R or params is not None and param.name not in params:
            continue
        n = world * strategy.parts if is_flat(home) else world  # a flat one: every rank
        shape = param.out.shape
        dims = [d for d in range(len(shape)) if shape[d] % n == 0]
        if not dims or n == 1:
            whole.append(param.name)
            continue
        shard = Shard(0 if 0 in dims else max(dims, key=lambda d: shape[d]))
        homes[param.name] = flat(shard) if is_flat(home) else shard
        changed = True
    if not changed:
        return strategy
    notes = (f"{len(whole)} of {len(graph.params)} parameters kept whole (no dim divides by "
             f"{world}): {', '.join(whole[:3])}{' ...' if len(whole) > 3 else ''}",) if whole \
        else ()
    stored = {p.name for p in graph.params if homes.get(p.name) != strategy.placements.get(p.name)}
    return replace(strategy, placements=homes, notes=strategy.notes + notes,
                   reshard=strategy.reshard | stored if reshard else strategy.reshard)


FIXED = {"ddp": data_parallel, "fsdp": fully_sharded, "megatron": megatron,
         "megatron-sp": megatron_sp, "expert": expert_parallel}
TENSOR_PARALLEL = ("megatron", "megatron-sp")
# on a mesh: the strategy along its innermost axis (inside each machine), data parallel over
# every other axis (fsdp+tp: with every parameter that can be stored sharded over all of those
# and sequence parallelism inside, as torchtitan's FSDP + tensor parallelism; hsdp: FSDP inside
# each machine, replicated across them, as fully_shard on a 2-D DeviceMesh runs hybrid
# sharding; hsdp+tp, on a 3-D mesh: fsdp+tp with the parameters stored sharded over the middle
# axis only, replicated across the machines, as torchtitan's HSDP + tensor parallelism)
ACROSS = {"hsdp": "fsdp", "dp-megatron": "megatron", "dp-expert": "expert",
          "fsdp+tp": "megatron-sp", "hsdp+tp": "megatron-sp", "tp+ep": "megatron"}


def tensor_and_expert(graph: Graph, mesh: Mesh) -> Strategy:
    """Megatron inside each machine with the batch split across the machines (dp-megatron),
    except where expert parallelism over every GPU differs from data parallelism (the experts,
    their dispatch and return): those ops run expert's options over the mesh flattened
    (hidup.graph.placement's flat placements), so each GPU holds experts / GPUs of them,
    reached by all-to-all over the world. So do the ops after them that Megatron would read
    them in as Partial sums (a router's output, where Megatron splits its experts inside each
    machine), which expert's leave complete."""
    tp = fixed_strategy("dp-megatron", graph, mesh.world, mesh)
    ep, dp = expert_parallel(graph, mesh.world), data_parallel(graph, mesh.world)
    region = {n for n in ep.options if ep.options[n] != dp.options[n]}
    for node in graph.ops:  # (in topological order: the region grows forward)
        if any(t in region and isinstance(p, Partial)
               for t, p in zip(node.inputs, tp.options[node.name].inputs)):
            region.add(node.name)
    read = {t for n in region for t in graph.node(n).inputs}
    placements = {t: flat(ep.placements[t]) if t in read and graph.node(t).kind == "param"
                  else p for t, p in tp.placements.items()}
    options = {n: flat_option(ep.options[n]) if n in region else o for n, o in tp.options.items()}
    return replace(tp, name="tp+ep", placements=placements, options=options)


def fixed_strategies(graph: Graph, world: int, mesh: Mesh | None = None
                     ) -> dict[str, Strategy]:
    """Every fixed strategy that applies to the model and world size (expert needs expert
    weights; none may end up as a replicated run under its own name); on a `mesh` of 2 or more
    machines also those of ACROSS that apply to it."""
    out = {}
    for name in [*FIXED, *(ACROSS if mesh and mesh.size("machines") > 1 else ())]:
        try:
            out[name] = fixed_strategy(name, graph, world, mesh)
        except ValueError:
            continue
    return out


def fixed_strategy(name: str, graph: Graph, world: int, mesh: Mesh | None = None) -> Strategy:
    """The fixed strategy `name` on `world` ranks; an error where it would not be what its name
    says (a batch that does not split, nothing split at all), with notes where it departs in part
    (tensor-parallel weights left whole because their dims do not divide). The names of FIXED
    span every rank (a 1-D mesh); those of ACROSS need a `mesh` of 2 or more machines (data
    parallel over every axis but the innermost; hsdp+tp a 3-D one)."""
    if name not in FIXED and name not in ACROSS:
        raise ValueError(f"unknown strategy {name!r}; choose one of "
                         f"{sorted(FIXED) + sorted(ACROSS)} or a plan file")
    if name in FIXED:
        strategy = FIXED[name](graph, world)
        return strategy if world == 1 else _as_named(name, graph, strategy, world)
    dp = mesh.names[:-1] if mesh else ()
    if not dp or mesh.world != world or any(mesh.size(a) < 2 for a in dp) or \
            name == "hsdp+tp" and len(dp) < 2:
        flag = "of 3 axes, --mesh MACHINESxBLOCKSxGPUS" if name == "hsdp+tp" else \
            "--mesh MACHINESxGPUS"
        raise ValueError(f"strategy {name} runs {ACROSS[name]} inside each machine and data "
                         f"parallel across machines: it needs a mesh of the {world} GPUs of 2 "
                         f"or more machines, with 2 or more ranks on every axis but the "
                         f"innermost ({flag}), not {mesh or 'one machine'}")
    if name == "tp+ep":
        return tensor_and_expert(graph, mesh)
    inner = mesh.size(mesh.names[-1])
    strategy = FIXED[ACROSS[name]](graph, inner)
    strategy = _as_named(name, graph, strategy, inner, mesh.size(dp))
    strategy = replace(strategy, name=name, mesh=mesh, dp=dp)
    if name == "fsdp+tp":
        return stored_across(graph, strategy, inner)
    return stored_across(graph, strategy, inner, dp[1:]) if name == "hsdp+tp" else strategy


def stored_across(graph: Graph, strategy: Strategy, inner: int,
                  axes: tuple[str, ...] | None = None) -> Strategy:
    """`strategy` (on a mesh of `inner` ranks per row) with every parameter that can be stored
    sharded over its dp `axes` (default: all of them) so: on the first dim of its row's piece
    that those axes divide and that the row's ranks do not split already, where its gradient
    is whole in a row (no op reads it whole to make a split or Partial output). The others
    stay whole over them, with a note."""
    axes = strategy.dp if axes is None else axes
    machines, across, kept = strategy.mesh.size(axes), {}, []
    partial = {t for node in graph.ops for t, p in zip(node.inputs, strategy.options[node.name]
                                                       .inputs)
               if strategy.options[node.name].partial_gradient(p)}
    for param in graph.params:
        home = strategy.home(param.name)
        if is_flat(home):  # over every rank already
            continue
        shape = list(param.out.shape)
        if isinstance(home, Shard):
            shape[home.dim] //= inner
        dims = [d for d, n in enumerate(shape) if n % machines == 0 and home != Shard(d)]
        if not dims or home == R and param.name in partial:
            kept.append(param.name)
            continue
        across[param.name] = dims[0]
    notes = (f"{len(kept)} of {len(graph.params)} parameters kept whole {axes_words(axes)}: "
             f"{', '.join(kept[:3])}{' ...' if len(kept) > 3 else ''}",) if kept else ()
    return replace(strategy, notes=strategy.notes + notes, across=across,
                   across_axes=axes if across else ())


def _as_named(name: str, graph: Graph, strategy: Strategy, world: int,
              machines: int = 1) -> Strategy:
    """`strategy` if it splits what `name` promises on `world` ranks (of each of `machines`
    machines, data parallel across), else a ValueError that says which dims do not divide and
    what would."""
    base = ACROSS.get(name, name)
    split = world * machines if base in ("ddp", "fsdp", "expert") else machines
    for node in graph.user_inputs if split > 1 else ():
        size = node.out.shape[0] if node.out.shape else 1
        if size % split:
            raise ValueError(
                f"strategy {name} on {world * machines} GPUs: the batch of {size} (input "
                f"{node.name}) does not split into {split} equal parts; give a --batch that is "
                f"a multiple of {split}, or a GPU count that divides {size} "
                f"({_divisors(size)})")
    weights = _tensor_parallel_weights(graph) if base in TENSOR_PARALLEL else []
    whole = [w for w in weights if strategy.placements.get(w) == R]
    if weights and len(whole) == len(weights) or not strategy.split_ops:
        dims = sorted({d for w in weights for d in graph.node(w).out.shape}) or \
            sorted({n.out.shape[0] for n in graph.user_inputs if n.out.shape})
        raise ValueError(
            f"strategy {name} on {world} GPUs splits nothing: no dimension it would split "
            f"({', '.join(map(str, dims))}) divides by {world}, so every op would run "
            f"replicated; choose a GPU count among {_divisors(math.gcd(*dims))} or another "
            f"strategy")
    if whole:
        shapes = ", ".join(f"{w} {list(graph.node(w).out.shape)}" for w in whole[:3])
        more = f" and {len(whole) - 3} more" if len(whole) > 3 else ""
        note = (f"{len(whole)} of {len(weights)} linear weights replicated (no dim divides by "
                f"{world}): {shapes}{more}")
        strategy = Strategy(strategy.name, strategy.placements, strategy.options, (note,),
                            reshard=strategy.reshard)
    return strategy


def _tensor_parallel_weights(graph: Graph) -> list[str]:
    """The 2-d parameters that linear layers read: what Megatron splits."""
    return [t for node in graph.ops if node.op.startswith("aten.linear") for t in node.inputs
            if graph.node(t).kind == "param" and len(graph.node(t).out.shape) == 2]


def _divisors(n: int) -> str:
    found = [d for d in range(2, min(n, 64) + 1) if n % d == 0]
    return ", ".join(map(str, found[:8])) if found else "none above 1"
