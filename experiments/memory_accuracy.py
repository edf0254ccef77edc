"""The memory model against real peaks: each case trains on gloo ranks of this CPU with
`hidup.parallelize` (AdamW) and the peak of live tensor memory per rank during a step, optimizer
included, is printed beside the memory model's prediction for the same Program
(hidup.planning.memory.peak_memory).

The measured peak: what a rank holds between steps (its parameter shards, buffers, optimizer
state and the batch; the user's model is dropped, as a run that builds it on the meta device
never holds it), plus the most bytes the CPU allocator had handed out beyond that during one
step, as torch.profiler's memory events report them (every allocation and free of the step's
tensors, the kernels' temporaries included). It is measured on a step after the first (traced,
optimizer state made).

`python -m experiments.memory_accuracy [--cases NAME ...] [--out DIR]` prints the table (one
row per case and rank) and the median and largest error; with --out it writes the rows as JSON.
`transformers` is a test dependency (the dev extra): the cases of its models need it.

`--device cuda` runs the GPU cases instead, in this process on one CUDA device: a `transformers`
Llama at a size where the step's tensors dwarf cuBLAS's workspace, fp32 and bf16, with Duplex
and recomputation. There the measured peak is `torch.cuda.max_memory_allocated` during a step
(the caching allocator's count of every live block, kernels' workspaces included) after the
first two, and where no layer is recomputed and k = 1, the same model trained by eager PyTorch
(autocast, torch's AdamW) is measured beside it."""
from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hidup.cli import Parser
from hidup.graph.saved import LiveStorages

PROFILE = "cpu-gloo-loopback"
WORLD = 2


@dataclass(frozen=True)
class Case:
    """One run: a model, a plan (a fixed strategy or the search's), micro-batches, which layers
    are recomputed ('none', 'all', 'selective': every layer), the precision."""

    model: str
    strategy: str
    k: int = 1
    recompute: str = "none"
    precision: str = "fp32"

    @property
    def name(self) -> str:
        extra = "" if self.recompute == "none" else f" recompute={self.recompute}"
        return f"{self.model} {self.strategy} k={self.k}{extra} {self.precision}"


# two `transformers` families at a size where the step's tensors, not the allocator's small
# blocks, make the peak
HF_LLAMA = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                use_cache=False)
HF_GPT2 = dict(vocab_size=2048, n_positions=128, n_embd=256, n_layer=4, n_head=8,
               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
# about 0.3 B parameters in 4 layers of Llama 3's shapes at 2,048 wide, 4 x 2,048 tokens: a GPU case
HF_LLAMA_GPU = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                    num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                    max_position_embeddings=2048, use_cache=False)
HF = {"hf-llama": ("LlamaConfig", "LlamaForCausalLM", HF_LLAMA, 8, 128),
      "hf-gpt2": ("GPT2Config", "GPT2LMHeadModel", HF_GPT2, 8, 128),
      "hf-llama-gpu": ("LlamaConfig", "LlamaForCausalLM", HF_LLAMA_GPU, 4, 2048)}

CASES = [Case(m, s, k, r) for m in ("gpt:small", "bert-sgmoe:small")
         for s, k, r in (("ddp", 1, "none"), ("ddp", 2, "none"), ("fsdp", 2, "none"),
                         ("megatron", 1, "none"), ("search", 2, "none"), ("ddp", 2, "all"))] + \
    [Case(m, s, k, r, p) for m in HF
     for s, k, r, p in (("ddp", 1, "none", "fp32"), ("fsdp", 2, "selective", "fp32"),
                        ("megatron", 2, "none", "fp32"), ("search", 2, "none", "fp32"),
                        ("fsdp", 2, "none", "bf16"))]
# on one GPU (--device cuda): one rank, so the single-device plan ('ddp' of one)
GPU_CASES = [Case("hf-llama-gpu", "ddp", k, r, p)
             for k, r, p in ((1, "none", "fp32"), (1, "none", "bf16"), (2, "none", "bf16"),
                             (1, "selective", "bf16"), (1, "all", "bf16"))]


def build(model: str, seed: int = 0):
    """(module whose forward returns the loss, one global batch) for a zoo name or HF."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if model in HF:
        import transformers

        from experiments.third_party import WithLoss
        config, cls, settings, batch, seq = HF[model]
        module = WithLoss(getattr(transformers, cls)(getattr(transformers, config)(**settings)),
                          ("input_ids", "labels"))
        ids = torch.randint(0, settings["vocab_size"], (batch, seq), generator=gen)
        return module.train(), (ids, ids.clone())
    from hidup.models import get_model
    spec = get_model(model, gpus=WORLD)
    return spec.build().train(), tuple(spec.inputs(spec.batch, gen))


def measure(case: Case, rank: int, world: int = WORLD, device: str = "cpu") -> dict:
    """Train the case on this rank of `world` on `device`; its predicted and measured peak
    bytes."""
    import hidup
    from hidup.graph.capture import capture
    from hidup.planning.memory import peak_memory
    from hidup.planning.planfile import Plan
    from hidup.planning.profile_file import load_profile
    from hidup.planning.select import Goal, select_plan
    from hidup.strategy import fixed_strategy, layers, recomputing

    model, batch = build(case.model)
    graph = capture(model, batch)
    if case.strategy == "search":
        goal = Goal(world, micro_batches=case.k, recompute="none", precision=case.precision)
        strategy = select_plan(graph, load_profile(PROFILE), goal).strategy
    else:
        strategy = fixed_strategy(case.strategy, graph, world)
    if case.recompute != "none":
        strategy = recomputing(graph, strategy, layers(graph), case.recompute == "selective")
    autocast = torch.bfloat16 if case.precision == "bf16" else None
    eager = _eager_peak(model, batch, autocast, device) \
        if device == "cuda" and case.k == 1 and case.recompute == "none" else None
    plan = Plan.of(graph, strategy, world, case.k, PROFILE, case.model, "adamw")
    trainer = hidup.parallelize(model, plan, optimizer=_adamw, device=device, autocast=autocast)
    del model
    batch = tuple(x.to(device) for x in batch)
    trainer.step(*batch)  # traced; the optimizer's state made
    gc.collect()
    if device == "cuda":
        held, peak = _cuda_step_peak(lambda: trainer.step(*batch))
    else:
        held, peak = _step_peak(trainer, batch)
    predicted = peak_memory(trainer.program)
    del trainer
    return {"case": case.name, "rank": rank, "predicted_mib": predicted.peak / 2**20,
            "measured_mib": peak / 2**20, "held_mib": held / 2**20,
            "error": predicted.peak / peak - 1, "plan": strategy.name,
            "eager_mib": None if eager is None else eager / 2**20}


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _cuda_step_peak(step) -> tuple[int, int]:
    """(bytes allocated on the CUDA device before a step, the most allocated during it), after
    two steps (the first one traced, or the optimizer's state made) and the allocator's cache
    emptied."""
    step()
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return held, torch.cuda.max_memory_allocated()


def _eager_peak(model, batch, autocast, device: str) -> int:
    """The CUDA peak of a step of eager PyTorch on a copy of `model`: the forward under
    `autocast`, the backward, torch's AdamW, gradients set to None."""
    module = copy.deepcopy(model).to(device)
    batch = tuple(x.to(device) for x in batch)
    opt = _adamw(module.parameters())

    def step():
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            loss = module(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step()
    _, peak = _cuda_step_peak(step)
    del module, opt, batch
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def _held_tensors(trainer, batch) -> list[torch.Tensor]:
    """What a rank holds between steps: its parameter shards, buffers, optimizer state and
    the batch."""
    tensors = [*trainer.executor.params.values(), *trainer.executor.buffers, *batch]
    for state in trainer.optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors


def _step_peak(trainer, batch) -> tuple[int, int]:
    """(bytes the rank holds between steps, the most bytes of live tensor storage during one
    step): every storage an op of the step returns (forward, backward, collectives and the
    optimizer, as a TorchDispatchMode sees them) counts from the op that made it until torch
    frees it. Kernels' scratch space inside one op is not seen, so this is a lower bound that
    does not move between runs."""
    with LiveStorages(_held_tensors(trainer, batch)) as live:
        trainer.step(*batch)
    return live.start, live.peak


def _rank(rank: int, store: str, cases: list[Case], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    rows = []
    try:
        for case in cases:
            rows.append(measure(case, rank))
            if rank == 0:
                print(f"  {case.name}: done", file=sys.stderr, flush=True)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # hidup.train's ranks end so too: no C++ teardown after the work is done


def run(cases: list[Case]) -> list[dict]:
    """Every case on WORLD gloo ranks; one row per case and rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        store = os.path.join(out_dir, "store")
        mp.spawn(_rank, args=(store, cases, out_dir), nprocs=WORLD, join=True)
        rows = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(WORLD)]
    return [row for pair in zip(*rows) for row in pair]


def run_cuda(cases: list[Case]) -> list[dict]:
    """Every case on one CUDA device, in this process."""
    rows = []
    for case in cases:
        rows.append(measure(case, 0, 1, "cuda"))
        gc.collect()
        torch.cuda.empty_cache()
        print(f"  {case.name}: done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    eager = any(r.get("eager_mib") is not None for r in rows)
    lines = ["| case | plan | rank | predicted (MiB) | measured (MiB) | error |" +
             (" eager PyTorch (MiB) | error to eager |" if eager else ""),
             "| --- | --- | --- | --- | --- | --- |" + (" --- | --- |" if eager else "")]
    for r in rows:
        line = (f"| {r['case']} | {r['plan']} | {r['rank']} | {r['predicted_mib']:.1f} | "
                f"{r['measured_mib']:.1f} | {r['error']:+.1%} |")
        if eager:
            mine = r.get("eager_mib")
            line += " |  |" if mine is None else \
                f" {mine:.1f} | {r['predicted_mib'] / mine - 1:+.1%} |"
        lines.append(line)
    errors = [abs(r["error"]) for r in rows]
    lines.append(f"\n{len(rows)} ranks: median |error| {statistics.median(errors):.1%}, largest "
                 f"{max(errors):.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = Parser(prog="python -m experiments.memory_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", metavar="NAME", default=None,
                    help=f"run only the cases whose name starts with one of these (e.g. "
                         f"'gpt:small ddp'); default: all {len(CASES)}")
    ap.add_argument("--out", type=Path, default=None, help="folder for rows.json")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu: the cases on 2 gloo ranks; cuda: the GPU cases on one CUDA "
                         "device (default: %(default)s)")
    args = ap.parse_args(argv)
    every = GPU_CASES if args.device == "cuda" else CASES
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this machine has no CUDA device")
    cases = every if args.cases is None else \
        [c for c in every if any(c.name.startswith(n) for n in args.cases)]
    if not cases:
        ap.error(f"--cases {' '.join(args.cases)}: no case starts so; the cases: "
                 f"{'; '.join(c.name for c in every)}")
    if args.device == "cuda":
        print(f"{len(cases)} cases on {torch.cuda.get_device_name()}, torch "
              f"{torch.__version__}...", file=sys.stderr, flush=True)
        rows = run_cuda(cases)
    else:
        print(f"{len(cases)} cases on {WORLD} gloo ranks...", file=sys.stderr, flush=True)
        rows = run(cases)
    print(table(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
