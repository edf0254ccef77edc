"""How far HiDup covers models it was not written for: for each third-party model
(experiments.third_party, tiny `transformers` configs), the graph's ops by where their sharding
options come from (an overlay rule, DTensor's strategies, or none: run replicated, listed), and
each plan of ddp, fsdp, megatron, expert (where the model has experts) and the search, with one
micro-batch and with two (Duplex), trained one step on 2 gloo ranks against eager
single-device training (loss and every gradient), with how many ops the plan splits.

    python -m experiments.model_coverage [--models gpt2,llama] [--plans ddp,search] [--gpus 2]
    python -m experiments.model_coverage --models Qwen2Config:Qwen2ForCausalLM
"""
from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hidup
from hidup.graph import ops
from hidup.graph.capture import capture

BATCH = 8
LR = 1e3  # one SGD step's update is -LR x the gradient: far above the weights, so rounding the
#          new weights loses ~1e-7 of the update (with lr 1, a gradient of 1e-3 on a weight of 1
#          is resolved to ~1e-4 only)
CLUSTER = "v100-8x8-10gbps"  # where sharding pays: on 2 of its GPUs the search splits the ops
#   (on cpu-gloo-loopback these tiny models' searched plans replicate every op)
PLANS = ("ddp", "fsdp", "megatron", "expert", "search")  # expert: where the model has experts


def _rank(rank: int, world: int, store: str, name: str, out: str, cases) -> None:
    """One rank: for each (plan, k) of `cases`, plan the model (fixed strategy or search, on
    CLUSTER), train one SGD step (lr LR) as a user would (hidup.parallelize) and, on rank 0,
    save the loss, the whole parameters, the plan's description and how many ops it splits;
    a plan that does not apply saves why."""
    from experiments.third_party import build, model_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    try:
        for how, k in cases:
            model = build(name)
            batch = model_spec(name).batch(BATCH, torch.Generator().manual_seed(1))
            try:
                plan = hidup.plan(model, batch, cluster=CLUSTER, gpus=world, optimizer="sgd",
                                  strategy=how, micro_batches=k, recompute="none")
            except ValueError as exc:  # the strategy does not apply (no experts, say)
                results[how, k] = str(exc).splitlines()[0]
                continue
            trainer = hidup.parallelize(model, plan,
                                        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
            loss = float(trainer.step(*batch))
            whole = trainer.full_state_dict()  # every rank: it gathers the shards
            results[how, k] = (loss, whole, plan.describe(), plan.strategy.split_ops)
        if rank == 0:
            torch.save(results, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def eager_step(name: str):
    """Eager PyTorch's loss, and each parameter's value before the step and gradient."""
    from experiments.third_party import build, model_spec

    eager = build(name)
    before = {n: p.detach().clone() for n, p in eager.named_parameters(remove_duplicate=False)}
    ref = eager(*model_spec(name).batch(BATCH, torch.Generator().manual_seed(1)))
    ref.backward()
    grads = {n: p.grad for n, p in eager.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return ref.item(), before, grads


def compare(eager, loss: float, trained: dict) -> tuple[bool, str]:
    """Whether one SGD step's loss and update (minus the gradient) equal eager PyTorch's."""
    ref, before, grads = eager
    named = [(n, g) for n, g in grads.items() if n in trained]
    if not named:
        return False, "no trained parameter to compare"
    # a gradient near zero holds rounding noise only: the floor is 1e-3 of the largest one
    floor = 1e-3 * max(float(g.norm()) for _, g in named)
    worst = max(float(((before[n] - trained[n]) / LR - g).norm() / max(float(g.norm()), floor))
                for n, g in named)
    ok = abs(loss - ref) <= 1e-5 * abs(ref) and worst <= 1e-4
    return ok, f"loss {loss:.6f} vs {ref:.6f}, worst gradient error {worst:.1e}"


def train_plans(name: str, world: int, cases) -> dict:
    """{(plan, k): (equal, detail, description, split ops) or why it does not apply}."""
    eager = eager_step(name)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), name, out, cases),
                 nprocs=world)
        runs = torch.load(out)
    return {case: run if isinstance(run, str) else (*compare(eager, run[0], run[1]), *run[2:])
            for case, run in runs.items()}


def coverage(name: str, world: int, cases) -> dict:
    """The model's ops by where their options come from, what falls back to replicated, and
    each plan of `cases` trained against eager."""
    from experiments.third_party import build, model_spec

    row = {"model": name}
    try:
        model = build(name)
        batch = model_spec(name).batch(BATCH, torch.Generator().manual_seed(1))
        graph = capture(model, batch)
        row.update(Counter(ops.source(graph, n) for n in graph.ops))
        row["replicated ops"] = dict(Counter(n.op for n in ops.replicated_ops(graph)))
    except Exception as exc:  # a row that says what failed, and the table goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    try:
        row["plans"] = train_plans(name, world, cases)
    except Exception as exc:  # training failed on a rank: the row says how
        row["error"] = f"training failed: {str(exc).strip().splitlines()[-1][:200]}"
    return row


def main(argv=None) -> int:
    from experiments.third_party import MODELS, MORE_SPECS

    families = [*MODELS, *MORE_SPECS]
    p = argparse.ArgumentParser(prog="python -m experiments.model_coverage",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", default=",".join(families),
                   help=f"comma-separated, from {', '.join(families)} (default: all), or any "
                        f"transformers model as ConfigClass:ModelClass (e.g. "
                        f"Qwen2Config:Qwen2ForCausalLM), built at a tiny size")
    p.add_argument("--plans", default=",".join(PLANS),
                   help=f"comma-separated strategies to train, from {', '.join(PLANS)} and the "
                        f"other fixed ones (default: {','.join(PLANS)}; expert only where the "
                        f"model has experts)")
    p.add_argument("--gpus", type=int, default=2, help="gloo ranks to train on (default 2)")
    p.add_argument("--micro-batches", default="1,2", metavar="K[,K]",
                   help="micro-batch counts to train each plan with (1: plain SPMD, 2 or more: "
                        "Duplex; default 1,2)")
    args = p.parse_args(argv)
    cases = [(how, int(k)) for how in args.plans.split(",") for k in
             args.micro_batches.split(",")]
    print(f"on {args.gpus} gloo ranks, plans for {CLUSTER}; split: ops run on a part of a "
          f"tensor; equal: loss and every gradient as eager PyTorch's")
    print(f"{'model':12} {'ops':>4} {'overlay':>7} {'dtensor':>7} {'replic.':>7}  "
          f"{'plan':8} {'k':>1} {'split':>5}  equal")
    summary = Counter()
    for name in args.models.split(","):
        row = coverage(name, args.gpus, cases)
        if "error" in row:
            print(f"{name:12} fails: {row['error']}")
            summary["fails"] += 1
            continue
        total = row.get("overlay", 0) + row.get("dtensor", 0) + row.get("replicated", 0)
        head = (f"{name:12} {total:4d} {row.get('overlay', 0):7d} {row.get('dtensor', 0):7d} "
                f"{row.get('replicated', 0):7d}")
        for (how, k), run in row["plans"].items():
            if isinstance(run, str):  # the plan does not apply to this model: said, but for
                if how != "expert":  # expert on a model without experts
                    summary["n/a"] += 1
                    print(f"{head}  {how:8} {k:1d}   n/a  {run}")
                    head = " " * len(head)
                continue
            equal, detail, _, split = run
            summary["runs"] += 1
            summary["equal"] += equal
            print(f"{head}  {how:8} {k:1d} {split:5d}  {'yes' if equal else 'NO'} ({detail})")
            head = " " * len(head)
        fallback = ", ".join(f"{op} x{n}" for op, n in row["replicated ops"].items())
        print(f"{'':12} no rule, run replicated: {fallback or 'none'}")
        summary["models"] += 1
    print(f"{summary['models']} models planned; {summary['equal']} of {summary['runs']} runs "
          f"equal to eager" + (f"; {summary['n/a']} did not apply" if summary["n/a"] else "")
          + (f"; {summary['fails']} models failed" if summary["fails"] else ""))
    return 0 if summary["equal"] == summary["runs"] and not summary["fails"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
