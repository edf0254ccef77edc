"""Repeated layers priced once: for a zoo model, each fixed strategy (as it is, with every layer
recomputed selectively, and with its first five layers recomputed) priced from the whole Program
and from short copies of the model (hidup.planning.extrapolate), side by side: the step time,
the peak memory, their relative difference and the seconds each took.

    python -m experiments.repeated_layers [--model llama:8b] [--cluster h100-8x-ib-bf16] [--gpus 8]
"""
from __future__ import annotations

import argparse
import math
import time

from hidup.graph.dtypes import run_dtypes
from hidup.models import capture_model, get_model
from hidup.planning.extrapolate import Pricer
from hidup.planning.profile_file import load_profile
from hidup.strategy import first_layers, fixed_strategy, layers, recomputing

STRATEGIES = ("ddp", "fsdp", "megatron", "megatron-sp")


def _variants(graph, plan):
    yield "", plan
    yield "+selective", recomputing(graph, plan, layers(graph), True)
    yield "+first5", recomputing(graph, plan, first_layers(graph, 5))


def _timed(graph, plan, gpus, k, profile, min_ops):
    start = time.perf_counter()
    priced = Pricer(graph, gpus, profile, min_ops=min_ops).price(plan, k)
    return priced, time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.repeated_layers",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--model", default="llama:8b", help="zoo model NAME:SIZE (default llama:8b)")
    p.add_argument("--cluster", default="h100-8x-ib-bf16",
                   help="cluster profile (default h100-8x-ib-bf16)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs (default 8)")
    args = p.parse_args(argv)
    spec = get_model(args.model, args.gpus)
    profile = load_profile(args.cluster)
    graph = run_dtypes(capture_model(spec, spec.batch), profile.precision, profile.device)
    print(f"{args.model} on {args.gpus} GPUs of {args.cluster} ({len(graph.ops)} ops), AdamW; "
          f"whole Program vs short copies")
    for name in STRATEGIES:
        for tag, plan in _variants(graph, fixed_strategy(name, graph, args.gpus)):
            for k in (1, 2):
                whole, t_whole = _timed(graph, plan, args.gpus, k, profile, math.inf)
                short, t_short = _timed(graph, plan, args.gpus, k, profile, 0)
                how = "short copies" if short.extrapolated else "whole (not extrapolated)"
                print(f"{name + tag:>22} k={k}: step {whole.estimate.step_time * 1e3:.2f} / "
                      f"{short.estimate.step_time * 1e3:.2f} ms "
                      f"({short.estimate.step_time / whole.estimate.step_time - 1:+.1e}), "
                      f"peak {whole.memory.peak / 2**30:.2f} / {short.memory.peak / 2**30:.2f} "
                      f"GiB ({short.memory.peak / whole.memory.peak - 1:+.1e}); "
                      f"{t_whole:.2f} / {t_short:.2f} s; {how}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
