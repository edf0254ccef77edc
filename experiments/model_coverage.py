"""How far HiDup covers models it was not written for: for each third-party model
(experiments.third_party, tiny `transformers` configs), the graph's ops by where their sharding
options come from (an overlay rule, DTensor's strategies, or none: replicated), the time
`hidup.plan` takes to search a plan, and whether that plan trained on 2 gloo ranks equals eager
single-device training (loss and every gradient).

    python -m experiments.model_coverage [--models gpt2,llama] [--gpus 2] [--micro-batches 2]
    python -m experiments.model_coverage --models Qwen2Config:Qwen2ForCausalLM
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
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
CLUSTER = "cpu-gloo-loopback"


def _rank(rank: int, world: int, store: str, name: str, out: str, k: int | None) -> None:
    """One rank: plan the model, train one SGD step (lr LR), save the loss and the whole
    parameters."""
    from experiments.third_party import build, model_spec

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        model = build(name)
        batch = model_spec(name).batch(BATCH, torch.Generator().manual_seed(1))
        plan = hidup.plan(model, batch, cluster=CLUSTER, gpus=world, optimizer="sgd",
                          micro_batches=k)
        trainer = hidup.parallelize(model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR))
        loss = float(trainer.step(*batch))
        whole = trainer.full_state_dict()  # every rank: it gathers the shards
        if rank == 0:
            torch.save((loss, whole), out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def equals_eager(name: str, world: int, k: int | None = None) -> tuple[bool, str]:
    """Train one step of the searched plan (with k micro-batches; None: as HiDup chooses) on
    `world` ranks; compare loss and update (minus the
    gradient) with eager PyTorch's."""
    from experiments.third_party import build, model_spec

    eager = build(name)
    before = {n: p.detach().clone() for n, p in eager.named_parameters(remove_duplicate=False)}
    ref = eager(*model_spec(name).batch(BATCH, torch.Generator().manual_seed(1)))
    ref.backward()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        mp.spawn(_rank, args=(world, os.path.join(tmp, "store"), name, out, k), nprocs=world)
        loss, trained = torch.load(out)
    named = [(n, p) for n, p in eager.named_parameters(remove_duplicate=False)
             if p.grad is not None and n in trained]
    # a gradient near zero holds rounding noise only: the floor is 1e-3 of the largest one
    floor = 1e-3 * max((float(p.grad.norm()) for _, p in named), default=1.0)
    errors = [float(((before[n] - trained[n]) / LR - p.grad).norm() / max(float(p.grad.norm()), floor))
              for n, p in named]
    if not errors:
        return False, "no trained parameter to compare"
    worst = max(errors)
    ok = abs(loss - ref.item()) <= 1e-5 * abs(ref.item()) and worst <= 1e-4
    return ok, f"loss {loss:.6f} vs {ref.item():.6f}, worst gradient error {worst:.1e}"


def coverage(name: str, world: int, k: int | None = None) -> dict:
    from experiments.third_party import build, model_spec

    row = {"model": name}
    try:
        model = build(name)
        batch = model_spec(name).batch(BATCH, torch.Generator().manual_seed(1))
        graph = capture(model, batch)
        row.update(Counter(ops.source(graph, n) for n in graph.ops))
        row["replicated ops"] = sorted({n.op for n in ops.replicated_ops(graph)})
        start = time.perf_counter()
        plan = hidup.plan(model, batch, cluster=CLUSTER, gpus=world, micro_batches=k)
        row["plan s"] = time.perf_counter() - start
        row["plan"] = plan.describe()
    except Exception as exc:  # a row that says what failed, and the table goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return row
    try:
        row["equal"], row["detail"] = equals_eager(name, world, k)
    except Exception as exc:  # training failed on a rank: the row says how
        row["equal"] = False
        row["detail"] = f"training failed: {str(exc).strip().splitlines()[-1][:200]}"
    return row


def main(argv=None) -> int:
    from experiments.third_party import MODELS

    p = argparse.ArgumentParser(prog="python -m experiments.model_coverage",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: all), or any "
                        f"transformers model as ConfigClass:ModelClass (e.g. "
                        f"Qwen2Config:Qwen2ForCausalLM), built at a tiny size")
    p.add_argument("--gpus", type=int, default=2, help="gloo ranks to train on (default 2)")
    p.add_argument("--micro-batches", type=int, default=None, metavar="K",
                   help="plan with K micro-batches per rank (1: plain SPMD, 2 or more: Duplex; "
                        "default: as hidup.plan chooses)")
    args = p.parse_args(argv)
    print(f"{'model':8} {'ops':>4} {'overlay':>7} {'dtensor':>7} {'replic.':>7} {'plan s':>6}  "
          f"equals eager on {args.gpus} ranks")
    for name in args.models.split(","):
        row = coverage(name, args.gpus, args.micro_batches)
        if "error" in row:
            print(f"{name:8} fails: {row['error']}")
            continue
        total = row.get("overlay", 0) + row.get("dtensor", 0) + row.get("replicated", 0)
        print(f"{name:8} {total:4d} {row.get('overlay', 0):7d} {row.get('dtensor', 0):7d} "
              f"{row.get('replicated', 0):7d} {row['plan s']:6.2f}  "
              f"{'yes' if row['equal'] else 'NO'} ({row['detail']})")
        print(f"{'':8} plan: {row['plan']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
