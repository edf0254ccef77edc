"""HiDup's executor against plain PyTorch on the same module and optimizer, side by side in one run:
`python -m experiments.executor_overhead` (one process: eager PyTorch, and for k=2 eager with two
accumulated micro-batches, against hidup k=1 and k=2 in each executor mode) or
`torchrun --nproc-per-node 2 -m experiments.executor_overhead --models gpt:small` (hidup's ddp
plan against torch.nn.parallel.DistributedDataParallel, micro-batches under no_sync; with
`--plans fsdp search --fully-shard --memory GIB`, also hidup's fsdp plan and the plan hidup.plan
chooses within that memory, against PyTorch's FSDP2, torch.distributed.fsdp.fully_shard). The
contestants take turns, a few steps each, for several rounds; each prints its median step and
its ratio to the baseline: the median over rounds of the ratio within a round (this machine's
speed drifts between rounds). On CUDA, --busy also reads each contestant's GPU busy time (the
union of its kernels in a profiler trace) and prints step / busy."""
from __future__ import annotations

import copy
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import hidup
from calibration.traced_run import issued_tasks
from hidup.cli import Parser
from hidup.graph.capture import capture
from hidup.planning.memory import peak_memory
from hidup.planning.planfile import Plan
from hidup.models import get_model
from hidup.planning.profile_file import load_profile
from hidup.strategy import Mesh, fixed_strategy
from hidup.strategy.fixed import ACROSS
from hidup.program import lower
from hidup.runtime.execute import Executor

log = logging.getLogger(__name__)
PROG = "python -m experiments.executor_overhead"


@dataclass
class Row:
    model: str
    precision: str
    k: int
    contestant: str  # 'eager', 'ddp', 'fully_shard', 'hidup graph', 'hidup compile',
    #   'hidup cuda-graphs' ('hidup PLAN MODE' for a plan other than ddp)
    baseline: str
    median_ms: float
    ratio: float = 1.0  # median over rounds of (step / the baseline's step in that round)
    busy_ms: float | None = None  # GPU busy time of one step (--busy)
    host_ms: float | None = None  # host time to issue one step on an idle GPU (--busy)
    tasks: int | None = None  # hidup: the tasks the host issues in one step (costs.issues)


def parse_args(argv=None):
    ap = Parser(prog=PROG, description=__doc__)
    ap.add_argument("--models", nargs="+", default=["gpt:tiny", "bert-sgmoe:tiny", "mlp:small"],
                    help="models NAME:SIZE (default: %(default)s)")
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2],
                    help="hidup's k; eager accumulates the same number of micro-batches")
    ap.add_argument("--modes", nargs="+", default=None,
                    choices=["graph", "compile", "cuda-graphs"],
                    help="executor modes (default: graph and compile; cuda-graphs too on CUDA)")
    ap.add_argument("--plans", nargs="+", default=["ddp"],
                    help="hidup's plans: fixed strategies (ddp, fsdp, megatron, megatron-sp, "
                         "expert; fsdp+tp, dp-megatron, dp-expert on --cluster's mesh) or "
                         "'search', the plan hidup.plan chooses for --cluster within --memory "
                         "(default: %(default)s)")
    ap.add_argument("--cluster", default="cpu-gloo-loopback",
                    help="the profile 'search' plans for (default: %(default)s)")
    ap.add_argument("--memory", type=float, default=None,
                    help="device memory limit 'search' plans within, GiB (default: the "
                         "profile's)")
    ap.add_argument("--fully-shard", action="store_true",
                    help="under torchrun, also race PyTorch's FSDP2 (fully_shard on each block "
                         "of every ModuleList, then the model), and give every ratio to it")
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd",
                    help="every contestant's optimizer: sgd (lr 0.01; hidup's update is in its "
                         "compiled step) or adamw (torch.optim.AdamW, lr 1e-3, on each rank's "
                         "shards: hidup runs through hidup.parallelize); the search plans for it "
                         "(default: %(default)s)")
    ap.add_argument("--precision", nargs="+", choices=["fp32", "bf16"], default=["fp32"],
                    help="fp32, or bf16 autocast (both sides alike)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (default: the model's)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of turns (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per turn (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op CPU threads (default: 1)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: CUDA where there is one")
    ap.add_argument("--busy", action="store_true",
                    help="CUDA: also read GPU busy time per step, and the host's time to issue "
                         "one")
    ap.add_argument("--out", type=Path, default=None, help="also write the rows as JSON here")
    args = ap.parse_args(argv)
    ap.at_least_one(args, "rounds", "steps", "threads", "batch")
    if min(args.micro_batches) < 1:
        ap.error("every --micro-batches must be at least 1")
    if args.memory is not None and not args.memory > 0:
        ap.error(f"--memory {args.memory}: must be a positive number of GiB")
    return args


def contestants(name: str, k: int, precision: str, modes, device, world: int, rank: int,
                args) -> tuple[dict, dict]:
    """name -> (one training step, no sync) on the same model, weights, optimizer and batch;
    and for hidup's contestants, name -> the tasks the host issues in a step."""
    spec = get_model(name, gpus=world)
    batch = args.batch or spec.batch
    data = [x.to(device) for x in spec.inputs(batch, torch.Generator().manual_seed(1))]
    dtype = torch.bfloat16 if precision == "bf16" else None
    torch.manual_seed(0)
    model = spec.build()
    example = spec.inputs(batch, torch.Generator().manual_seed(0))
    graph = capture(model, example)  # on the CPU
    sharded = copy.deepcopy(model).to(device) if args.fully_shard and world > 1 else None
    model.to(device)
    inputs = dict(zip([n.source for n in graph.user_inputs], data))
    out, tasks = {}, {}
    for plan_name in args.plans:
        plan, kk = _plan(plan_name, model, graph, example, world, k, args)
        program = lower(graph, plan, world, kk, name, optimizer=args.optimizer)
        log.info("%s, lowered: %s", plan_name, peak_memory(program))
        tag = "hidup" if plan_name == "ddp" else f"hidup {plan_name}"
        for mode in modes:
            tasks[f"{tag} {mode}"] = issued_tasks(program)
            if args.optimizer == "adamw":  # the user's torch.optim optimizer on the shards
                trainer = hidup.parallelize(
                    copy.deepcopy(model), Plan.of(graph, plan, world, kk), optimizer=_adamw,
                    compile=mode == "compile", cuda_graphs=mode == "cuda-graphs",
                    device=device, micro_batches=kk, autocast=dtype)
                out[f"{tag} {mode}"] = lambda t=trainer: t.step(*data)
                continue
            ex = Executor(graph, plan, program, dict(model.named_parameters()), 0.01, device,
                          buffers=dict(model.named_buffers()), autocast=dtype, mode=mode)
            out[f"{tag} {mode}"] = lambda ex=ex: ex.step(inputs)
    if world > 1:
        mine = [x.chunk(world)[rank] for x in data]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        out["ddp"] = _eager_step(ddp, mine, k, dtype, device, ddp.no_sync, args.optimizer)
        if sharded is not None:
            out["fully_shard"] = _eager_step(_fully_shard(sharded, world, device), mine, k,
                                             dtype, device, None, args.optimizer)
    else:
        out["eager"] = _eager_step(model, data, k, dtype, device, None, args.optimizer)
    return out, tasks


def _plan(name: str, model, graph, example, world: int, k: int, args):
    """hidup's plan `name` (a fixed strategy, or hidup.plan's choice for 'search') and its
    micro-batch count."""
    if name != "search":  # on the cluster's mesh where the strategy needs one (fsdp+tp)
        mesh = Mesh.of_machines(*load_profile(args.cluster).mesh(world)) if name in ACROSS \
            else None
        return fixed_strategy(name, graph, world, mesh), k
    memory = None if args.memory is None else args.memory * 2**30
    chosen = hidup.plan(model, example, cluster=args.cluster, gpus=world, micro_batches=k,
                        memory=memory, optimizer=args.optimizer)
    log.info("search on %s within %s: %s", args.cluster,
             "its memory" if memory is None else f"{args.memory:g} GiB", chosen.describe())
    return chosen.strategy, chosen.micro_batches


def _fully_shard(model, world: int, device):
    """PyTorch's FSDP2 as torchtitan applies it: each block of every ModuleList its own unit,
    then the whole model (what is left: embeddings, head)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world,))
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _eager_step(module, data, k: int, dtype, device, no_sync, optimizer: str = "sgd"):
    """One plain PyTorch step of `module` on `data` in k accumulated micro-batches, SGD or
    AdamW: DDP (`no_sync`) reduces once, after the last; FSDP2 syncs gradients on the last
    only."""
    opt = _adamw(module.parameters()) if optimizer == "adamw" else \
        torch.optim.SGD(module.parameters(), lr=0.01)
    chunks = list(zip(*(x.chunk(k) for x in data)))

    def step():
        for i, part in enumerate(chunks):
            last = i == len(chunks) - 1
            if hasattr(module, "set_requires_gradient_sync"):
                module.set_requires_gradient_sync(last)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None), \
                    (nullcontext() if no_sync is None or last else no_sync()):
                loss = module(*part)
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def race(runs: dict, rounds: int, steps: int, device) -> dict[str, list[float]]:
    """Each contestant's step (seconds) in each round, taking turns: `steps` steps each."""
    for fn in runs.values():  # trace, compile, capture and warm up
        for _ in range(3):
            fn()
    sync(device)
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            sync(device)
            times[name].append((time.perf_counter() - start) / steps)
    return times


def busy_seconds(fn, device) -> float:
    """GPU busy time of one step: the union of its kernels' spans in a profiler trace."""
    sync(device)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        sync(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy * 1e-6


def host_seconds(fn, device, repeats: int = 5) -> float:
    """Median host time to issue one step with the GPU idle when it starts (the call returns
    once the host has queued the step's work; a CUDA graph's replay is one call)."""
    spans = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        spans.append(time.perf_counter() - start)
    sync(device)
    return statistics.median(spans)


def measure(args, device, world: int, rank: int) -> list[Row]:
    modes = args.modes or (["graph", "compile"] + (["cuda-graphs"] if device.type == "cuda"
                                                   else []))
    rows = []
    for name in args.models:
        for precision in args.precision:
            for k in args.micro_batches:
                runs, tasks = contestants(name, k, precision, modes, device, world, rank,
                                          args)
                base = "eager" if world == 1 else "fully_shard" if args.fully_shard else "ddp"
                times = race(runs, args.rounds, args.steps, device)
                for who, mine in times.items():
                    gpu = args.busy and device.type == "cuda"
                    busy = busy_seconds(runs[who], device) if gpu else None
                    host = host_seconds(runs[who], device) if gpu else None
                    # the ratio within each round (this machine's speed drifts between rounds)
                    ratio = statistics.median(a / b for a, b in zip(mine, times[base]))
                    rows.append(Row(name, precision, k, who, base, 1e3 * statistics.median(mine),
                                    ratio, None if busy is None else 1e3 * busy,
                                    None if host is None else 1e3 * host, tasks.get(who)))
                    if rank == 0:
                        log.info("%s", _line(rows[-1]))
    return rows


def _line(row: Row) -> str:
    busy = "" if row.busy_ms is None else \
        f"  busy {row.busy_ms:.2f} ms (step / busy {row.median_ms / row.busy_ms:.2f})"
    if row.host_ms is not None:
        busy += f"  host {row.host_ms:.2f} ms" + (
            "" if not row.tasks else f" ({1e3 * row.host_ms / row.tasks:.1f} us x {row.tasks})")
    return (f"{row.model:16s} {row.precision} k={row.k} {row.contestant:24s} "
            f"{row.median_ms:8.2f} ms  {row.ratio:.3f}x {row.baseline}{busy}")


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        rows = measure(args, device, world, rank)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    finally:
        if world > 1:
            dist.destroy_process_group()
    if rank == 0:
        torch_line = f"torch {torch.__version__}, {world} rank(s), " + (
            torch.cuda.get_device_name(device) if cuda else f"CPU, {args.threads} thread(s)")
        print(f"{PROG} {' '.join(sys.argv[1:] if argv is None else argv)}\n{torch_line}")
        for row in rows:
            print(_line(row))
        if args.out is not None:
            args.out.write_text(json.dumps({"setup": torch_line,
                                            "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
