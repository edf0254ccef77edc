"""On one CUDA device, what a GPU run must show before its speed counts: `python -m
experiments.gpu_checks` (needs a GPU and `transformers`).

1. Models nobody here wrote (experiments.third_party's tiny `transformers` configs), planned with
   `hidup.plan` for one H100 and trained through `hidup.parallelize` with torch's AdamW, equal
   to eager PyTorch on the same device: the loss and every gradient of the first step, in each
   executor mode and with 1 and 2 micro-batches. In fp32 (TF32 off) each relative error is at
   most 1e-4. Under bf16 autocast both sides round, differently (micro-batches, fused kernels):
   each of hidup's gradients is then no further from eager's fp32 gradient than twice eager's
   own bf16 gradient is, plus 1e-2.
2. After the first steps (tracing, compiling, capturing), a whole Trainer step, the optimizer's
   update included, passes under `torch.cuda.set_sync_debug_mode("error")`: nothing in it waits
   for the GPU.

Each case prints one line; the exit status is the number of failed cases."""
from __future__ import annotations

import argparse
import copy
import sys
import time

import torch

import hidup
from experiments.third_party import MODELS, build

PROG = "python -m experiments.gpu_checks"
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-2}
BATCH = 8


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def eager_first_step(model, batch, dtype, device):
    """Loss and gradients of eager PyTorch's first step on `device`."""
    model = copy.deepcopy(model).to(device)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        loss = model(*batch)
    loss.backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return float(loss.detach()), grads


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """Norm-wise relative error; the denominator is at least `scale` (1e-3 of the largest
    gradient's norm: a gradient that is zero in exact arithmetic holds only rounding)."""
    return float((a.float() - b.float()).norm() / max(float(b.norm()), scale, 1e-30))


def no_host_sync(trainer, data, device) -> str:
    """After two more steps, whether a step passes under sync debug mode "error"."""
    if device.type != "cuda":
        return "no host sync"  # nothing to wait for on a CPU (a dry run)
    for _ in range(2):
        trainer.step(*data)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.step(*data)
        return "no host sync"
    except RuntimeError as exc:
        return f"HOST SYNC: {str(exc).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def check_case(name: str, precision: str, mode: str, k: int, device) -> tuple[bool, str]:
    """One model, precision, executor mode and micro-batch count: equal to eager, and (after
    three steps) a step with no host sync."""
    dtype = torch.bfloat16 if precision == "bf16" else None
    model = build(name)
    batch = MODELS[name].batch(BATCH, torch.Generator().manual_seed(1))
    example = MODELS[name].batch(BATCH, torch.Generator().manual_seed(0))
    cluster = "h100-bf16" if precision == "bf16" else "h100"
    plan = hidup.plan(model, example, cluster=cluster, gpus=1, micro_batches=k)
    ref_loss, ref_grads = eager_first_step(model, [x.to(device) for x in batch], None, device)
    # under bf16: how far eager's own bf16 step lands from its fp32 step
    rounding = None if dtype is None else _rounding(
        eager_first_step(model, [x.to(device) for x in batch], dtype, device), ref_loss,
        ref_grads)
    trainer = hidup.parallelize(copy.deepcopy(model), plan, optimizer=_adamw, device=device,
                                compile=mode == "compile", cuda_graphs=mode == "cuda-graphs",
                                autocast=dtype)
    data = [x.to(device) for x in batch]
    grads = {}  # the gradients the optimizer steps on (the Trainer frees them after the step)
    sources = {n.name: n.source for n in trainer.graph.params}

    def record(*_):
        grads.update({sources[n]: p.grad.detach().clone()
                      for n, p in trainer.executor.params.items() if p.grad is not None})
    hook = trainer.optimizer.register_step_pre_hook(record)
    loss = float(trainer.step(*data))
    hook.remove()
    scale = 1e-3 * max(float(g.norm()) for g in ref_grads.values())
    tol = TOLERANCE[precision]
    # (how far over its bound, the error, the bound, the name): the worst gradient
    worst = max(_over(rel_err(g.reshape(ref_grads[n].shape), ref_grads[n], scale),
                      2 * rounding[n] + tol if rounding else tol, n)
                for n, g in grads.items())
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    loss_bound = 2 * rounding["loss"] + tol if rounding else tol
    missing = sorted(set(ref_grads) - set(grads) - set(trainer._tied))
    synced = no_host_sync(trainer, data, device)
    ok = loss_err <= loss_bound and worst[0] <= 1 and not missing and synced == "no host sync"
    return ok, (f"loss err {loss_err:.1e} (bound {loss_bound:.1e}), gradient nearest its bound "
                f"{worst[3]} {worst[1]:.1e} (bound {worst[2]:.1e})"
                f"{', missing ' + str(missing) if missing else ''}; {synced}; "
                f"plan: {plan.describe().splitlines()[0]}")


def _over(err: float, bound: float, name: str) -> tuple:
    return err / bound, err, bound, name


def _rounding(eager_bf16, ref_loss: float, ref_grads: dict) -> dict:
    """Eager bf16's relative error against eager fp32: each gradient's by name, the loss's
    under "loss"."""
    (loss16, grads16), scale = eager_bf16, 1e-3 * max(float(g.norm()) for g in ref_grads.values())
    out = {n: rel_err(grads16[n], g, scale) for n, g in ref_grads.items()}
    out["loss"] = abs(loss16 - ref_loss) / abs(ref_loss)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,llama,bert,mixtral,vit,resnet",
                    help="comma-separated, from " + ", ".join(MODELS) + " (default: all)")
    ap.add_argument("--cases", nargs="+",
                    default=["fp32:graph:1", "fp32:graph:2", "bf16:compile:2",
                             "bf16:cuda-graphs:2"],
                    help="PRECISION:MODE:K cases to run on each model (default: %(default)s)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a dry run of the equality checks (no sync check; default: cuda)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA device; this machine has none (--device cpu for a dry run)")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {unknown}; choose from {sorted(MODELS)}")
    cases = []
    for text in args.cases:
        parts = text.split(":")
        if len(parts) != 3 or parts[0] not in TOLERANCE or \
                parts[1] not in ("graph", "compile", "cuda-graphs") or not parts[2].isdigit():
            ap.error(f"--cases {text!r}: write PRECISION:MODE:K, e.g. bf16:compile:2 (precision "
                     f"fp32 or bf16; mode graph, compile or cuda-graphs)")
        cases.append((parts[0], parts[1], int(parts[2])))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"{PROG}: torch {torch.__version__}, {where}", flush=True)
    failed = 0
    for name in models:
        for precision, mode, k in cases:
            start = time.perf_counter()
            try:
                ok, text = check_case(name, precision, mode, k, device)
            except Exception as exc:  # noqa: BLE001 - report every case, then the count
                ok, text = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:8s} {precision} {mode:11s} k={k}: {text} "
                  f"[{time.perf_counter() - start:.1f} s]", flush=True)
    print(f"{failed} of {len(models) * len(cases)} cases failed")
    return min(failed, 125)


if __name__ == "__main__":
    sys.exit(main())
