"""Planning full-size models built on the meta device (no weights allocated): `transformers` models
of the published shapes of Llama 3 8B, Mixtral 8x7B, Gemma 2 9B (42 layers) and Qwen3-30B-A3B (48
layers of 128 experts), by default on 64 GPUs of `v100-8x8-10gbps`. Prints, per
model, the time to build it, to capture it (torch.export), the whole `hidup.plan` (capture, and
the search on the 8 x 8 mesh and over every GPU with the fixed strategies ranked beside it), the
planning process's peak memory, the plan (or why none fits) and its predicted step and peak
memory per GPU (plain SGD, as planned). Each model is planned in a process of its own, so that
the peak memory is its own.

    python -m experiments.meta_planning [--models llama3-8b,mixtral-8x7b,gemma2-9b,qwen3-moe-30b]
                                        [--gpus 64] [--batch 128] [--seq 512] [--cluster C]

`transformers` is a test dependency (the dev extra): `pip install -e ".[dev]"`.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

# transformers config class, model class, settings: the published shapes
MODELS = {
    "llama3-8b": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, use_cache=False)),
    "mixtral-8x7b": ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
        num_experts_per_tok=2, max_position_embeddings=32768, use_cache=False)),
    "gemma2-9b": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=8192,
        sliding_window=4096, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, use_cache=False)),
    "qwen3-moe-30b": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=40960, use_cache=False)),
}


def meta_model(name: str, batch: int, seq: int):
    """The model of MODELS[name] built on the meta device (the loss out of `forward`), and a
    batch of `batch` x `seq` token ids and labels for it, on the meta device too."""
    import torch
    import transformers

    from experiments.third_party import WithLoss

    config, model_class, settings = MODELS[name]
    with torch.device("meta"):
        model = WithLoss(getattr(transformers, model_class)(
            getattr(transformers, config)(**settings)), ("input_ids", "labels"))
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids, ids)


def plan_one(name: str, gpus: int, batch: int, seq: int, cluster: str) -> dict:
    """Build `name` on the meta device and plan it; the timings and the outcome."""
    import transformers  # noqa: F401 (imported before the build is timed)

    import hidup
    from hidup.graph.capture import capture
    from hidup.graph.dtypes import run_dtypes
    from hidup.planning.estimate import estimate
    from hidup.planning.memory import peak_memory
    from hidup.planning.profile_file import load_profile
    from hidup.program import lower

    start = time.perf_counter()
    model, (ids, _) = meta_model(name, batch, seq)
    row = {"model": name, "params (B)": sum(p.numel() for p in model.parameters()) / 1e9,
           "build s": time.perf_counter() - start}
    start = time.perf_counter()
    graph = capture(model, (ids, ids))
    row["capture s"], row["ops"] = time.perf_counter() - start, len(graph.ops)
    start = time.perf_counter()
    try:
        plan = hidup.plan(model, (ids, ids), cluster=cluster, gpus=gpus, optimizer="sgd")
        row["plan"] = plan.describe()
    except ValueError as exc:
        row["plan"], plan = f"none: {exc}", None
    row["plan s"] = time.perf_counter() - start
    if plan is not None:  # the chosen plan's predicted step and peak, lowered whole
        profile = load_profile(cluster)
        program = lower(run_dtypes(plan.graph, plan.precision, profile.device), plan.strategy,
                        gpus, plan.micro_batches, optimizer="sgd")
        row["step ms"] = estimate(program, profile).step_time * 1e3
        row["plan GiB"] = peak_memory(program).peak / 2**30
    row["peak GiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.meta_planning",
                                description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    p.add_argument("--gpus", type=int, default=64, help="GPUs to plan for (default 64)")
    p.add_argument("--batch", type=int, default=128, help="global batch, sequences (default 128)")
    p.add_argument("--seq", type=int, default=512, help="sequence length (default 512)")
    p.add_argument("--cluster", default="v100-8x8-10gbps",
                   help="cluster profile (default v100-8x8-10gbps)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: plan this model only
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(plan_one(args.one, args.gpus, args.batch, args.seq, args.cluster)))
        return 0
    for name in args.models.split(","):
        if name not in MODELS:
            p.error(f"model {name!r}: choose from {', '.join(MODELS)}")
        out = subprocess.run([sys.executable, "-m", "experiments.meta_planning", "--one", name,
                              "--gpus", str(args.gpus), "--batch", str(args.batch),
                              "--seq", str(args.seq), "--cluster", args.cluster],
                             capture_output=True, text=True)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-2000:]}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name}: {row['params (B)']:.2f} B parameters, {row['ops']} ops; build "
              f"{row['build s']:.2f} s, capture {row['capture s']:.2f} s, hidup.plan "
              f"{row['plan s']:.2f} s (capture included), peak memory {row['peak GiB']:.2f} GiB")
        print(f"  plan: {row['plan']}")
        if "step ms" in row:
            print(f"  predicted step {row['step ms']:.1f} ms, peak {row['plan GiB']:.2f} GiB "
                  f"per GPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
