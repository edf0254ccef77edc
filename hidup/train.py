"""The training command, `python -m hidup.train` (its options: hidup.train_options; the model it
names: hidup.train_model): data, model, graph and strategy made alike on every rank (`prepare`),
then the run (`run`): hidup.parallelize's Trainer with a torch.optim optimizer and schedule,
checkpoints (hidup.runtime.checkpoint), a line per step and the result."""
from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from hidup.cli import end_on_interrupt, exit_main, interrupt_held, say

if __name__ == "__main__":  # Ctrl-C in the seconds the imports take is one line too
    end_on_interrupt("python -m hidup.train", importing=True)

import torch
import torch.distributed as dist

from hidup.graph.capture import Graph, capture
from hidup.models import ModelSpec, capture_model
from hidup.planning.planfile import resolve_strategy
from hidup.strategy import Strategy
from hidup.program import Program, lower
from hidup.runtime import checkpoint
from hidup.runtime.data import (DataError, Vocabulary, build_vocabulary, eval_batches, load_tokens,
                                perplexity, random_batch)
from hidup.runtime.launch import default_threads, launch
from hidup.runtime.trainer import RunOptions, Trainer
from hidup.train_model import model_spec
from hidup.train_options import PROG, TrainOptions, parse_args

log = logging.getLogger(__name__)


class Diverged(Exception):
    """The loss became NaN or infinite: the run stops (exit code 4)."""


@dataclass(frozen=True)
class Prepared:
    """What a run needs before its ranks meet: the same on every rank, so a bad flag stops every
    rank alike, and the launcher can check it before starting any."""

    spec: ModelSpec
    vocab: Vocabulary | None  # None without --data
    tokens: torch.Tensor | None
    batch: int
    k: int
    graph: Graph
    strategy: Strategy
    program: Program | None  # lowered when only checking (the Trainer lowers its own)
    model: torch.nn.Module | None  # None when only checking a zoo model


def prepare(args: TrainOptions, world: int, check_only: bool = False) -> Prepared:
    """Data, model, graph and strategy for `world` ranks (raises ValueError naming what is
    wrong); check_only: a zoo model's graph from the meta-device capture, no weights built, and
    the Program lowered (the Trainer lowers its own when running)."""
    vocab = build_vocabulary(args.data) if args.data else None
    spec = model_spec(args, world, vocab)
    if vocab is not None and spec.task not in ("lm", "mlm"):
        raise DataError(f"--data is text; model {spec.name} trains on {spec.task} inputs")
    tokens = load_tokens(args.data, vocab) if vocab else None
    if args.eval is not None:
        load_tokens(args.eval, vocab)  # readable, before any step is run
    batch = args.batch or spec.batch
    k = args.k
    model = None
    if check_only and spec.task != "user":
        graph = capture_model(spec, batch)
    else:
        torch.manual_seed(args.seed)
        model = spec.build()
        example = spec.inputs(batch, torch.Generator().manual_seed(args.seed))
        graph = capture(model, example)
        if spec.task == "user":  # text (integer batch x sequence first input): tokens/s
            first = example[0]
            seq = first.shape[1] if first.dim() == 2 and not first.is_floating_point() else 0
            spec = ModelSpec(spec.name, spec.build, spec.inputs, spec.batch, spec.task, seq)
    strategy = resolve_strategy(args.strategy, graph, world)
    program = lower(graph, strategy, world, k, args.model, optimizer=args.optimizer) \
        if check_only else None
    return Prepared(spec, vocab, tokens, batch, k, graph, strategy, program, model)


def setup(args: TrainOptions, world: int) -> tuple[int, torch.device]:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device(f"cuda:{local}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    if world > 1:  # a lost peer ends a collective with an error after --timeout, not a hang
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None,
                                timeout=timedelta(seconds=args.timeout))
    rank = dist.get_rank() if world > 1 else 0
    return rank, device


def optimizer_factory(name: str, lr: float):
    """A function of the parameters (this rank's shards) returning the torch.optim optimizer
    that --optimizer `name` runs (calibration.ops times the same one)."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=lr)
    return lambda params: torch.optim.AdamW(params, lr=lr)


def lr_factor(step: int, warmup: int, steps: int, schedule: str) -> float:
    """The learning rate of step `step` (0-based) over --lr: a linear warm-up over `warmup`
    steps, then constant or a cosine decay to 0 at `steps`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def schedule_factory(args: TrainOptions):
    """A function of the optimizer returning its torch.optim.lr_scheduler (LambdaLR)."""
    warmup, steps, schedule = args.warmup_steps, args.steps, args.schedule
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, steps, schedule))


def run(args: TrainOptions) -> dict:
    from hidup.api import Plan

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or default_threads())
    p = prepare(args, world)
    rank, device = setup(args, world)
    spec, vocab, batch, k, graph, strategy = p.spec, p.vocab, p.batch, p.k, p.graph, p.strategy
    plan = Plan.of(graph, strategy, world, k, model=args.model, optimizer=args.optimizer)
    options = RunOptions(compile=args.compile, cuda_graphs=args.cuda_graphs, device=device,
                         micro_batches=k,
                         autocast=torch.bfloat16 if args.precision == "bf16" else None)
    trainer = Trainer(p.model, plan, optimizer_factory(args.optimizer, args.lr),
                      schedule_factory(args), options)
    names_in = [n.source for n in graph.user_inputs]
    losses, times, rss, lrs, first = [], [], [], [], 0
    run_id = checkpoint.RunId(args.model, batch, args.seed, args.optimizer)
    about = {"strategy": strategy.name, "world": world, "micro_batches": k}
    if args.resume:
        first, losses = checkpoint.load(args.checkpoint, trainer, run_id)
        if rank == 0:
            log.info("resumed from %s after step %d (strategy %s, %d ranks, %d micro-batches)",
                     args.checkpoint, first, strategy.name, world, k)
    saved = first if args.resume else None  # the last complete checkpoint's step
    unit = "tokens" if spec.seq else "samples"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(first, args.steps):
        gen = torch.Generator().manual_seed(args.seed + 1 + step)
        data = random_batch(p.tokens, spec.task, batch, spec.seq, gen) if vocab else \
            spec.inputs(batch, gen)
        tracing = args.trace is not None and step == args.steps - 1
        lrs.append(float(trainer.optimizer.param_groups[0]["lr"]))  # this step's
        with _profiler(tracing, device) as prof:
            _sync(world, device)
            start = time.perf_counter()
            loss = trainer.step(*data, labels=tracing)
            _sync(world, device)
            times.append(time.perf_counter() - start)
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            raise Diverged(_diverged(args, step + 1, losses[-1], saved))
        rss.append(_resident_mb())
        if tracing:
            out = args.trace if rank == 0 else args.trace.with_name(f"{args.trace.name}.rank{rank}")
            _write_trace(prof, out)
        if rank == 0:
            log.info("%s", _step_line(step + 1, args.steps, losses[-1], lrs[-1], times[-1],
                                      batch * max(spec.seq, 1), unit, rss[-1], device))
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0:
            with interrupt_held():  # Ctrl-C waits for the checkpoint to be whole
                checkpoint.save(args.checkpoint, step + 1, trainer, losses, run_id,
                                lambda: _sync(world, device), about)
            saved = step + 1
    timed = times[args.warmup:] or times
    median = statistics.median(timed or [0.0])
    result = {"model": args.model, "strategy": strategy.name, "world": world, "micro_batches": k,
              "batch": batch, "losses": losses, "step_times_ms": [1e3 * t for t in times],
              "median_step_ms": 1e3 * median,
              "median_over_steps": len(timed), "resumed_after": first, "resident_mb": rss,
              "optimizer": args.optimizer, "lr": args.lr, "warmup_steps": args.warmup_steps,
              "schedule": args.schedule, "lrs": lrs, "unit": unit,
              "median_per_s": batch * max(spec.seq, 1) / median if median else 0.0}
    if device.type == "cuda":
        result["max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    if args.eval:
        held_out = load_tokens(args.eval, vocab)
        scores = [float(trainer.executor.step(dict(zip(names_in, b)), update=False))
                  for b in eval_batches(held_out, spec.task, batch, spec.seq, args.eval_batches)]
        result["eval_loss"] = statistics.fmean(scores)
        result["eval_perplexity"] = perplexity(result["eval_loss"])
        result["eval_batches"] = len(scores)
    if world > 1:
        dist.destroy_process_group()
    return result


def _step_line(step: int, steps: int, loss: float, lr: float, seconds: float, items: int,
               unit: str, resident: float, device: torch.device) -> str:
    """Rank 0's line for a step, as torchtitan's: loss, throughput, learning rate, memory."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
        total = torch.cuda.get_device_properties(device).total_memory
        memory = f"memory {peak / 2 ** 30:.2f} GiB ({100 * peak / total:.1f}%)"
    else:
        memory = f"memory {resident:.1f} MiB resident"
    return (f"step {step}/{steps}  loss {loss:.5f}  {items / seconds:,.0f} {unit}/s  "
            f"lr {lr:.3e}  {memory}  {1e3 * seconds:.1f} ms")


def _diverged(args: TrainOptions, step: int, loss: float, saved: int | None) -> str:
    kept = ""
    if args.checkpoint is not None:
        kept = f"; the last complete checkpoint (step {saved}) is in {args.checkpoint}" \
            if saved else f"; no checkpoint was written in {args.checkpoint} yet"
    return (f"{PROG}: error: step {step}: the loss is {loss} (--lr {args.lr:g}); training stopped; "
            f"try a smaller --lr{kept}")


def _write_trace(prof, out: Path) -> None:
    """The profiler's Chrome trace, through a temporary file renamed when complete (the name
    keeps its ending: .gz compresses)."""
    tmp = out.with_name(f".{os.getpid()}.tmp.{out.name}")
    with interrupt_held():
        try:
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)


def _peer_failure(exc: RuntimeError) -> bool:
    """A collective that failed because of another rank or the network (gloo and NCCL raise
    plain RuntimeErrors, newer versions DistError; gloo's words vary with where it was when the
    peer went: 'Timed out', 'Connection reset by peer', 'Application timeout caused pair
    closure', ...)."""
    text = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        mark in text for mark in ("gloo", "nccl", "timed out", "timeout", "connection reset",
                                  "connection closed", "closed by peer", "pair closure"))


def _resident_mb() -> float:
    """This process's resident memory (MiB), from /proc (0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _sync(world, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if world > 1:
        dist.barrier()


def _profiler(enabled: bool, device):
    if not enabled:
        return nullcontext()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=acts)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if (args.nproc_per_node or 1) > 1 and "RANK" not in os.environ:  # start the ranks
            prepare(args, args.nproc_per_node, check_only=True)  # bad flags stop here, in one line
            argv = sys.argv[1:] if argv is None else list(argv)
            return launch("hidup.train", argv, args.nproc_per_node, f"{PROG}: error")
        result = run(args)
    except ValueError as exc:
        say(f"{PROG}: error: {exc}", every_rank=isinstance(exc, checkpoint.CheckpointError))
        return 2
    except Diverged as exc:
        say(str(exc))
        return 4
    except RuntimeError as exc:  # a peer lost, stuck past --timeout, or its link cut
        if not _peer_failure(exc):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        kept = f"; the last complete checkpoint is in {args.checkpoint} (--resume)" \
            if args.checkpoint else ""
        say(f"{PROG}: error: rank {os.environ.get('RANK', '0')}: a collective failed, a peer is "
            f"lost or did not answer within --timeout {args.timeout:g} s ({first}){kept}",
            every_rank=True)
        return 3
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{result['model']} strategy={result['strategy']} world={result['world']} "
                  f"micro-batches={result['micro_batches']} batch={result['batch']}: "
                  f"final loss {result['losses'][-1]:.5f}, median step "
                  f"{result['median_step_ms']:.2f} ms over {result['median_over_steps']} steps")
            rss = result["resident_mb"]
            if rss:  # after step 10 (or the last, if fewer) and after the last step
                early = min(len(rss), 10)
                said = f"{rss[early - 1]:.1f} MiB after step {result['resumed_after'] + early}"
                if early < len(rss):
                    said += f", {rss[-1]:.1f} MiB after step {args.steps}"
                print(f"resident memory of rank 0: {said}")
            if "eval_perplexity" in result:
                print(f"evaluation on {args.eval}: loss {result['eval_loss']:.4f}, perplexity "
                      f"{result['eval_perplexity']:.2f} ({result['eval_batches']} batches)")
    return 0


if __name__ == "__main__":
    exit_main(main)
