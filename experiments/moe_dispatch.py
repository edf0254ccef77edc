"""Routed experts both ways, predicted: a `transformers` MoE (by default the published shape of
Qwen3-30B-A3B: 48 layers of 128 experts, 8 per token) built on the meta device, under `expert`
(data parallel, the experts split over the GPUs, each token's routed rows sent to its experts'
GPUs and back by all-to-all) and under the same plan with every router reading all the batch's
rows on every GPU, each GPU computing its experts' rows, a Partial sum reduced after the router
(the other expert-parallel option of a router's region). Prints, per way, the predicted step,
what one GPU sends and receives per step by collective, and the predicted peak memory per GPU
(at the profile's precision, SGD, every layer recomputed unless --recompute says otherwise;
plain SPMD, or Duplex with --micro-batches).

    python -m experiments.moe_dispatch [--model qwen3-moe-30b] [--gpus 8] [--batch 16]
                                       [--seq 8192] [--cluster h100-8x-ib-bf16]

With --real FAMILY it measures instead: a tiny `transformers` MoE family of
experiments.third_party trained on 2 gloo ranks of this machine under both options, plain and
with Duplex, each step's median time beside the simulator's prediction on cpu-gloo-loopback.

    python -m experiments.moe_dispatch --real qwen2_moe [--batch 64] [--steps 15]

`transformers` is a test dependency (the dev extra): `pip install -e ".[dev]"`."""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import replace

from hidup.cli import number
from hidup.graph import ops
from hidup.graph.placement import P, R, Shard, ShardingOption
from hidup.graph.tokens import TOKENS
from hidup.program.tasks import Compute, Convert


def gathered(graph, strategy):
    """`strategy` with each router whose rows it splits reading every row instead, its experts
    still split: each GPU computes its experts' rows of the whole batch, a Partial sum, which
    the ops after it that can (a sum over each token's experts) carry on as a Partial sum
    before it is reduced (the plan the search would make of that option)."""
    options, partial = dict(strategy.options), set()
    for node in graph.ops:
        if node.op == TOKENS and any(node.args[0].experts):
            options[node.name] = ShardingOption(
                tuple(Shard(0) if e else R for e in node.args[0].experts), P)
            partial.add(node.name)
        elif any(t in partial for t in node.inputs):
            carried = ShardingOption(tuple(P if t in partial else p for t, p in
                                           zip(node.inputs, options[node.name].inputs)), P)
            if carried in ops.node_options(graph, node):
                options[node.name] = carried
                partial.add(node.name)
    return replace(strategy, name="expert, rows gathered", options=options)


def traffic(program) -> Counter:
    """Bytes of each collective kind one rank takes part in per step (its whole tensor's, as a
    Convert counts them), the collectives inside ops included."""
    out = Counter()
    for t in program.tasks:
        if isinstance(t, Convert) and t.collective:
            out[t.kind] += t.bytes
        elif isinstance(t, Compute):
            for kind, nbytes in t.inner:
                out[kind] += nbytes
    return out


REAL = ("qwen2_moe", "qwen3_moe", "mixtral", "granite_moe")  # tiny families with routers
PROG = "python -m experiments.moe_dispatch"


def measured(args) -> None:
    """One rank of --real: each option's steps timed (the slowest rank's median), rank 0
    printing them beside the prediction."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from experiments.third_party import build, model_spec
    from hidup.graph.capture import capture
    from hidup.planning.profile_file import load_profile
    from hidup.program import lower
    from hidup.runtime.execute import Executor
    from hidup.runtime.launch import default_threads
    from hidup.strategy import fixed_strategy
    from simulator import simulate

    dist.init_process_group("gloo")
    torch.set_num_threads(default_threads())  # the ranks fill this machine's cores once
    rank, world = dist.get_rank(), dist.get_world_size()
    profile = load_profile("cpu-gloo-loopback")
    model = build(args.real)
    batch = model_spec(args.real).batch(args.batch, torch.Generator().manual_seed(0))
    graph = capture(model, batch)
    expert = fixed_strategy("expert", graph, world)
    inputs = dict(zip([n.source for n in graph.user_inputs], batch))
    if rank == 0:
        print(f"{args.real} (tiny) on {world} gloo ranks, batch {args.batch}, graph mode, SGD; "
              f"median of {args.steps} steps, predicted on cpu-gloo-loopback:", flush=True)
    for strategy in (expert, gathered(graph, expert)):
        for k in (1, 2):
            program = lower(graph, strategy, world, k, optimizer="sgd")
            ex = Executor(graph, strategy, program,
                          dict(model.named_parameters(remove_duplicate=False)),
                          buffers=dict(model.named_buffers()), lr=1e-4)
            for _ in range(3):  # the trace, and warm caches
                float(ex.step(inputs))
            times = []
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                float(ex.step(inputs))
                times.append(time.perf_counter() - start)
            slowest = torch.tensor(statistics.median(times))
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if rank == 0:
                predicted = simulate(program, profile).step_time
                print(f"  {strategy.name}, k = {k}: measured {number(slowest.item() * 1e3)} ms, "
                      f"predicted {number(predicted * 1e3)} ms", flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    from experiments.meta_planning import MODELS

    p = argparse.ArgumentParser(prog=PROG,
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    moe = [m for m in MODELS if "moe" in m or "mixtral" in m]
    p.add_argument("--model", default="qwen3-moe-30b", choices=moe,
                   help="the model shape (default qwen3-moe-30b)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (default 8: one machine)")
    p.add_argument("--batch", type=int, default=None,
                   help="global batch, sequences (default 16; with --real 64)")
    p.add_argument("--rank-run", action="store_true", help=argparse.SUPPRESS)  # a --real rank
    p.add_argument("--seq", type=int, default=8192, help="sequence length (default 8192)")
    p.add_argument("--cluster", default="h100-8x-ib-bf16",
                   help="cluster profile (default h100-8x-ib-bf16)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="Duplex's micro-batches per GPU (default 1: plain SPMD)")
    p.add_argument("--recompute", default="all", metavar="none|all|N|selective",
                   help="layers recomputed in the backward, as simulator.predict's --recompute "
                        "(default all)")
    p.add_argument("--real", choices=REAL, default=None,
                   help="measure this tiny family on 2 gloo ranks of this machine instead (of "
                        "the options above, only --batch applies)")
    p.add_argument("--steps", type=int, default=15,
                   help="with --real: steps timed per option (default 15)")
    args = p.parse_args(argv)
    if args.batch is not None and args.batch < 2 or args.steps < 1:
        p.error(f"--batch {args.batch} --steps {args.steps}: give at least 2 sequences (one per "
                f"rank) and 1 step")
    if args.real:
        args.batch = args.batch or 64
        if args.rank_run:
            measured(args)
            return 0
        from hidup.runtime.launch import launch
        return launch("experiments.moe_dispatch", ["--rank-run", *(argv or sys.argv[1:])], 2,
                      PROG)
    args.batch = args.batch or 16
    from experiments.meta_planning import meta_model
    from hidup.graph.capture import capture
    from hidup.graph.dtypes import run_dtypes
    from hidup.planning.estimate import estimate
    from hidup.planning.memory import peak_memory
    from hidup.planning.profile_file import load_profile
    from hidup.program import lower
    from hidup.strategy import fixed_strategy, parse_recompute
    from hidup.strategy.recompute import recomputing, selective_part

    model, batch = meta_model(args.model, args.batch, args.seq)
    profile = load_profile(args.cluster)
    graph = capture(model, batch)
    try:
        expert = fixed_strategy("expert", graph, args.gpus)
    except ValueError as exc:
        p.error(str(exc))
    try:
        chosen = parse_recompute(args.recompute, graph)
    except ValueError as exc:
        p.error(str(exc))
    expert = recomputing(graph, expert, chosen, selective_part(args.recompute)[0])
    graph = run_dtypes(graph, profile.precision, profile.device)
    print(f"{args.model} on {args.gpus} GPUs of {args.cluster}, {args.batch} x {args.seq} tokens, "
          f"k = {args.micro_batches}, recomputed: {args.recompute}, SGD; per GPU:")
    for strategy in (expert, gathered(graph, expert)):
        program = lower(graph, strategy, args.gpus, args.micro_batches, optimizer="sgd")
        step = estimate(program, profile).step_time * 1e3
        moved = ", ".join(f"{kind} {number(b / 2**30)} GiB"
                          for kind, b in sorted(traffic(program).items()))
        print(f"  {strategy.name}: step {number(step)} ms, peak "
              f"{number(peak_memory(program).peak / 2**30)} GiB; {moved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
