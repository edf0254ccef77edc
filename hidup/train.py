"""Real training with a strategy: `python -m hidup.train --nproc-per-node N --model M --strategy S
[--duplex]` (or the same under torchrun, without --nproc-per-node). A zoo model (NAME:SIZE) or
your own (package.module:factory) trains through hidup.parallelize's Trainer with a torch.optim
optimizer and schedule; reports the loss, throughput, learning rate and memory per step and the
median step time after --warmup."""
from __future__ import annotations

import argparse
import importlib
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

from hidup.cli import Parser, end_on_interrupt, exit_main, interrupt_held, say

if __name__ == "__main__":  # Ctrl-C in the seconds the imports take is one line too
    end_on_interrupt("python -m hidup.train", importing=True)

import torch
import torch.distributed as dist

from hidup.graph import ops
from hidup.graph.capture import Graph, capture
from hidup.models import ModelSpec, capture_model, get_model, names
from hidup.planning.planfile import resolve_strategy
from hidup.strategy import Strategy
from hidup.program import Program, lower
from hidup.runtime import checkpoint
from hidup.runtime.data import (DataError, Vocabulary, build_vocabulary, eval_batches, load_tokens,
                                perplexity, random_batch)
from hidup.runtime.launch import default_threads, launch
from hidup.runtime.trainer import Trainer

log = logging.getLogger(__name__)
PROG = "python -m hidup.train"
EXIT_CODES = ("exit codes: 0 done; 2 bad input (one line names it); 3 a collective failed (a peer "
              "lost or stuck past --timeout); 4 the loss became NaN or infinite; 130 interrupted "
              "(Ctrl-C)")
DEFAULT_LR = {"adamw": 3e-4, "sgd": 0.01}
USER_BATCH = 8  # global batch of a user's model without --batch


class Diverged(Exception):
    """The loss became NaN or infinite: the run stops (exit code 4)."""


def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__, epilog=EXIT_CODES)
    ap.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                    help="start N ranks on this machine (gloo on the CPU), after checking every "
                         "flag; leave it out under torchrun")
    ap.add_argument("--model", default="gpt:tiny",
                    help=f"model NAME:SIZE, one of {names()}; or your own, package.module:factory "
                         f"(importable from here): factory() returns (module, inputs), "
                         f"module(*batch) returns the loss and inputs(batch_size, "
                         f"torch.Generator) returns the global batch, a tuple of tensors")
    ap.add_argument("--strategy", default="ddp",
                    help="'ddp', 'megatron', or the path of a plan file (python -m hidup.planner)")
    ap.add_argument("--duplex", action="store_true", help="Duplex: two micro-batches per rank")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="micro-batches per rank (overrides --duplex; 1 = plain SPMD)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compile", action="store_true",
                      help="run the traced step through torch.compile (Inductor), collectives "
                           "kept in the plan's order (default: the traced step as generated "
                           "Python, one call per ATen op)")
    mode.add_argument("--cuda-graphs", action="store_true",
                      help="CUDA: capture the traced step (forward, backward, NCCL collectives; "
                           "not the optimizer's update) once and replay it every step")
    ap.add_argument("--batch", type=int, default=None,
                    help=f"global batch size (default: the zoo model's; {USER_BATCH} for your own)")
    ap.add_argument("--steps", type=int, default=10,
                    help="training steps in all (a resumed run counts the steps done before; "
                         "--schedule cosine decays over them)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="timing only: first steps left out of the step-time median (0 or more, "
                         "below --steps); for the learning rate's warm-up see --warmup-steps")
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                    help="torch.optim.AdamW (its default betas, eps and weight decay) or plain "
                         "torch.optim.SGD (no momentum: the update the simulator's profiles "
                         "measure); default adamw")
    ap.add_argument("--lr", type=float, default=None,
                    help="peak learning rate (default: 3e-4 with adamw, 0.01 with sgd; a run "
                         "whose loss becomes NaN or infinite stops, exit code 4)")
    ap.add_argument("--warmup-steps", type=int, default=0, metavar="N",
                    help="learning-rate warm-up: the rate rises linearly over the first N steps "
                         "to --lr (step s of them at --lr * (s+1)/(N+1)); default 0")
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant",
                    help="learning rate after the warm-up: constant --lr, or cosine from --lr "
                         "down to 0 at --steps; default constant")
    ap.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the data")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default="auto",
                    help="process-group backend (auto: nccl with CUDA, else gloo)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op CPU threads per rank (default: cores / ranks on this machine, "
                         "all of an emulated cluster's)")
    ap.add_argument("--trace", type=Path, default=None,
                    help="write a torch.profiler Chrome trace of the last step (rank r > 0 adds "
                         ".rankR); its folder must exist")
    ap.add_argument("--data", type=Path, default=None,
                    help="train a text model on this WikiText-format file (vocabulary built "
                         "from it)")
    ap.add_argument("--eval", type=Path, default=None,
                    help="held-out WikiText-format file: print its perplexity after training")
    ap.add_argument("--eval-batches", type=int, default=20, help="batches of --eval to score")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: mixed precision, each op under torch.autocast in bfloat16 "
                         "(weights, gradients, communication and the optimizer stay float32)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds a collective may wait for a lost or stuck peer before the run "
                         "stops with an error (default 300)")
    ap.add_argument("--checkpoint", type=Path, default=None,
                    help="folder for checkpoints (torch.distributed.checkpoint, one step{S} "
                         "folder; latest.json names the last complete one)")
    ap.add_argument("--checkpoint-every", type=int, default=None, metavar="N",
                    help="write a checkpoint every N steps (needs --checkpoint)")
    ap.add_argument("--resume", action="store_true",
                    help="go on from the last checkpoint in --checkpoint: the same --model, "
                         "--batch, --seed and --optimizer as the run that wrote it; --strategy, "
                         "--micro-batches and the number of ranks may change. The losses are "
                         "those of an uninterrupted run")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = ap.parse_args(argv)
    if (args.checkpoint_every is not None or args.resume) and args.checkpoint is None:
        ap.error("--checkpoint-every and --resume need --checkpoint FOLDER")
    if args.eval is not None and args.data is None:
        ap.error("--eval needs --data (the vocabulary comes from the training file)")
    for flag in ("steps", "batch", "micro_batches", "threads", "eval_batches", "checkpoint_every",
                 "nproc_per_node"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            ap.error(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    if args.lr is None:
        args.lr = DEFAULT_LR[args.optimizer]
    if not (args.lr >= 0 and math.isfinite(args.lr)):
        ap.error(f"--lr must be a finite number, 0 or more, got {args.lr}; e.g. --lr 0.01")
    if args.warmup_steps < 0:
        ap.error(f"--warmup-steps must be 0 or more, got {args.warmup_steps} (steps of "
                 f"learning-rate warm-up)")
    if args.warmup < 0:
        ap.error(f"--warmup must be 0 or more, got {args.warmup} (steps left out of the median)")
    if args.warmup >= args.steps:
        ap.error(f"--warmup ({args.warmup}) must be below --steps ({args.steps}) to time any step")
    if args.trace is not None:
        folder = args.trace.parent
        if args.trace.is_dir():
            ap.error(f"--trace {args.trace} is a folder; give a file name such as "
                     f"{args.trace / 'trace.json'}")
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            ap.error(f"--trace {args.trace}: folder {folder} does not exist or is not writable; "
                     f"create it or choose another path")
    if args.checkpoint_every is not None:  # the folder checkpoints will be written in
        try:
            args.checkpoint.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            ap.error(f"--checkpoint {args.checkpoint}: cannot make the folder ({exc.strerror}); "
                     f"choose another path")
        if not os.access(args.checkpoint, os.W_OK):
            ap.error(f"--checkpoint {args.checkpoint}: the folder is not writable; choose "
                     f"another path")
    world = os.environ.get("WORLD_SIZE")
    if args.nproc_per_node is not None and world is not None and \
            args.nproc_per_node != int(world):
        ap.error(f"--nproc-per-node {args.nproc_per_node} under torchrun's {world} ranks; leave "
                 f"--nproc-per-node out under torchrun")
    return args


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


def user_model(arg: str) -> ModelSpec | None:
    """`--model package.module:factory`: the user's model as a ModelSpec (None where `arg` names
    a zoo model); raises ValueError, in one line with the fix, where it cannot be had."""
    module_name, colon, attr = arg.partition(":")
    zoo = {n.partition(":")[0] for n in names()}
    if module_name in zoo:
        return None
    if not colon or not attr or not module_name:
        if "." not in module_name:
            return None  # get_model says which zoo names there are
        raise ValueError(f"--model {arg}: give package.module:factory (a function returning "
                         f"(module, inputs)) or a zoo model NAME:SIZE")
    fix = (f"give a zoo model NAME:SIZE (e.g. {names()[0]}) or package.module:factory "
           f"importable from here (run from its folder or set PYTHONPATH)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if "." not in module_name and exc.name == module_name:
            return None  # a misspelt zoo name: get_model names the zoo
        raise ValueError(f"--model {arg}: cannot import {module_name} ({exc}); {fix}") from None
    except Exception as exc:  # the user's module failed while importing
        raise ValueError(f"--model {arg}: importing {module_name} failed ({type(exc).__name__}: "
                         f"{exc}); fix that module or {fix}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        what = "has no attribute" if factory is None else "has a non-callable"
        raise ValueError(f"--model {arg}: module {module_name} {what} {attr!r}; give a function "
                         f"of no arguments that returns (module, inputs), e.g. "
                         f"{module_name}:make_model")
    shape = ("it must return (module, inputs): an nn.Module whose module(*batch) returns the "
             "loss, and inputs(batch_size, generator) returning the global batch as a tuple of "
             "tensors")

    def build() -> tuple[torch.nn.Module, object]:
        try:
            made = factory()
        except Exception as exc:
            raise ValueError(f"--model {arg}: {attr}() raised {type(exc).__name__}: {exc}; "
                             f"{shape}") from None
        if not (isinstance(made, (tuple, list)) and len(made) == 2 and
                isinstance(made[0], torch.nn.Module) and callable(made[1])):
            got = type(made).__name__ if not isinstance(made, (tuple, list)) else \
                f"({', '.join(type(m).__name__ for m in made)})"
            raise ValueError(f"--model {arg}: {attr}() returned {got}; {shape}")
        return made[0], made[1]

    made: dict = {}

    def inputs(batch: int, gen: torch.Generator) -> tuple:
        if "inputs" not in made:
            made["inputs"] = build()[1]
        try:
            out = made["inputs"](batch, gen)
        except Exception as exc:
            raise ValueError(f"--model {arg}: inputs({batch}, generator) raised "
                             f"{type(exc).__name__}: {exc}; {shape}") from None
        if isinstance(out, torch.Tensor):
            out = (out,)
        if not (isinstance(out, (tuple, list)) and out and
                all(isinstance(t, torch.Tensor) for t in out)):
            raise ValueError(f"--model {arg}: inputs({batch}, generator) returned "
                             f"{type(out).__name__}; {shape}")
        return tuple(out)

    def module() -> torch.nn.Module:
        model, made["inputs"] = build()
        return model

    return ModelSpec(arg, module, inputs, USER_BATCH, "user")


def model_spec(args, world: int, vocab: Vocabulary | None) -> ModelSpec:
    spec = user_model(args.model)
    if spec is None:
        try:
            return get_model(args.model, gpus=world, vocab=len(vocab) if vocab else None)
        except ValueError as exc:
            if not str(exc).startswith("unknown model"):
                raise
            raise ValueError(f"{exc}; or give your own model as package.module:factory") from None
    if vocab is not None:
        raise DataError(f"--data is text for the zoo's text models; {args.model} makes its own "
                        f"batches (its inputs function)")
    return spec


def prepare(args, world: int, check_only: bool = False) -> Prepared:
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
    k = args.micro_batches or (2 if args.duplex else 1)
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


def setup(args, world: int) -> tuple[int, torch.device]:
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


def schedule_factory(args):
    """A function of the optimizer returning its torch.optim.lr_scheduler (LambdaLR)."""
    warmup, steps, schedule = args.warmup_steps, args.steps, args.schedule
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup, steps, schedule))


def run(args) -> dict:
    from hidup.api import Plan

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(args.threads or default_threads())
    p = prepare(args, world)
    rank, device = setup(args, world)
    spec, vocab, batch, k, graph, strategy = p.spec, p.vocab, p.batch, p.k, p.graph, p.strategy
    plan = Plan.of(graph, strategy, world, k, model=args.model, optimizer=args.optimizer)
    trainer = Trainer(p.model, plan, optimizer_factory(args.optimizer, args.lr),
                      schedule_factory(args),
                      compile=args.compile, device=device, micro_batches=k,
                      autocast=torch.bfloat16 if args.precision == "bf16" else None,
                      cuda_graphs=args.cuda_graphs)
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


def _diverged(args, step: int, loss: float, saved: int | None) -> str:
    kept = ""
    if args.checkpoint is not None:
        kept = f"; the last complete checkpoint (step {saved}) is in {args.checkpoint}" \
            if saved else f"; no checkpoint was written in {args.checkpoint} yet"
    return (f"hidup.train: step {step}: the loss is {loss} (--lr {args.lr:g}); training stopped; "
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
            return launch("hidup.train", argv, args.nproc_per_node, "hidup.train")
        result = run(args)
    except ValueError as exc:
        say(f"hidup.train: {exc}", every_rank=isinstance(exc, checkpoint.CheckpointError))
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
        say(f"hidup.train: rank {os.environ.get('RANK', '0')}: a collective failed, a peer is "
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
