"""The options of `python -m hidup.train`: `TrainOptions`, one field per flag, and `parse_args`,
the argument parser that fills it (every flag checked, in one line naming it, before any rank
starts). The training itself is hidup.train."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from hidup.cli import Parser
from hidup.models import names
from hidup.strategy import FIXED

PROG = "python -m hidup.train"
DESCRIPTION = """Real training with a strategy: `python -m hidup.train --nproc-per-node N
--model M --strategy S [--duplex]` (or the same under torchrun, without --nproc-per-node). A zoo
model (NAME:SIZE) or your own (package.module:factory) trains through hidup.parallelize's Trainer
with a torch.optim optimizer and schedule; reports the loss, throughput, learning rate and memory
per step and the median step time after --warmup."""  # --help's text (argparse rewraps it)
EXIT_CODES = ("exit codes: 0 done; 2 bad input (one line names it); 3 a collective failed (a peer "
              "lost or stuck past --timeout); 4 the loss became NaN or infinite; 130 interrupted "
              "(Ctrl-C)")
DEFAULT_LR = {"adamw": 3e-4, "sgd": 0.01}
USER_BATCH = 8  # global batch of a user's model without --batch


@dataclass(frozen=True)
class TrainOptions:
    """One training run's settings, a field per flag of `python -m hidup.train` (the defaults are
    the flags'; --help says what each means)."""

    nproc_per_node: int | None = None
    model: str = "gpt:tiny"
    strategy: str = "ddp"
    duplex: bool = False
    micro_batches: int | None = None
    compile: bool = False
    cuda_graphs: bool = False
    batch: int | None = None  # None: the zoo model's, USER_BATCH for a user's
    steps: int = 10
    warmup: int = 3  # timing only: steps left out of the median
    optimizer: str = "adamw"
    lr: float | None = None  # None: DEFAULT_LR of the optimizer (filled in)
    warmup_steps: int = 0  # learning-rate warm-up
    schedule: str = "constant"
    seed: int = 0
    backend: str = "auto"
    threads: int | None = None
    trace: Path | None = None
    data: Path | None = None
    eval: Path | None = None
    eval_batches: int = 20
    precision: str = "fp32"
    timeout: float = 300.0
    checkpoint: Path | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    json: bool = False

    def __post_init__(self):
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.optimizer])

    @property
    def k(self) -> int:
        """Micro-batches per rank: --micro-batches, else 2 with --duplex, else 1."""
        return self.micro_batches or (2 if self.duplex else 1)


def parser() -> Parser:
    """The argument parser of `python -m hidup.train` (its defaults are TrainOptions')."""
    d = TrainOptions
    ap = Parser(prog=PROG, description=DESCRIPTION, epilog=EXIT_CODES)
    ap.add_argument("--nproc-per-node", type=int, default=d.nproc_per_node, metavar="N",
                    help="start N ranks on this machine (gloo on the CPU), after checking every "
                         "flag; leave it out under torchrun")
    ap.add_argument("--model", default=d.model,
                    help=f"model NAME:SIZE, one of {names()}; or your own, package.module:factory "
                         f"(importable from here): factory() returns (module, inputs), "
                         f"module(*batch) returns the loss and inputs(batch_size, "
                         f"torch.Generator) returns the global batch, a tuple of tensors")
    ap.add_argument("--strategy", default=d.strategy,
                    help=f"a fixed strategy ({', '.join(FIXED)}) or the path of a plan file "
                         f"(python -m hidup.planner)")
    ap.add_argument("--duplex", action="store_true", help="Duplex: two micro-batches per rank")
    ap.add_argument("--micro-batches", type=int, default=d.micro_batches,
                    help="micro-batches per rank (overrides --duplex; 1 = plain SPMD)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--compile", action="store_true",
                      help="run the traced step through torch.compile (Inductor), collectives "
                           "kept in the plan's order (default: the traced step as generated "
                           "Python, one call per ATen op)")
    mode.add_argument("--cuda-graphs", action="store_true",
                      help="CUDA: capture the traced step (forward, backward, NCCL collectives; "
                           "not the optimizer's update) once and replay it every step")
    ap.add_argument("--batch", type=int, default=d.batch,
                    help=f"global batch size (default: the zoo model's; {USER_BATCH} for your own)")
    ap.add_argument("--steps", type=int, default=d.steps,
                    help="training steps in all (a resumed run counts the steps done before; "
                         "--schedule cosine decays over them)")
    ap.add_argument("--warmup", type=int, default=d.warmup,
                    help="timing only: first steps left out of the step-time median (0 or more, "
                         "below --steps); for the learning rate's warm-up see --warmup-steps")
    ap.add_argument("--optimizer", choices=["adamw", "sgd"], default=d.optimizer,
                    help="torch.optim.AdamW (its default betas, eps and weight decay) or plain "
                         "torch.optim.SGD (no momentum: the update the simulator's profiles "
                         "measure); default adamw")
    ap.add_argument("--lr", type=float, default=d.lr,
                    help="peak learning rate (default: 3e-4 with adamw, 0.01 with sgd; a run "
                         "whose loss becomes NaN or infinite stops, exit code 4)")
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps, metavar="N",
                    help="learning-rate warm-up: the rate rises linearly over the first N steps "
                         "to --lr (step s of them at --lr * (s+1)/(N+1)); default 0")
    ap.add_argument("--schedule", choices=["constant", "cosine"], default=d.schedule,
                    help="learning rate after the warm-up: constant --lr, or cosine from --lr "
                         "down to 0 at --steps; default constant")
    ap.add_argument("--seed", type=int, default=d.seed,
                    help="seed of the initial weights and the data")
    ap.add_argument("--backend", choices=["auto", "gloo", "nccl"], default=d.backend,
                    help="process-group backend (auto: nccl with CUDA, else gloo)")
    ap.add_argument("--threads", type=int, default=d.threads,
                    help="intra-op CPU threads per rank (default: cores / ranks on this machine, "
                         "all of an emulated cluster's)")
    ap.add_argument("--trace", type=Path, default=d.trace,
                    help="write a torch.profiler Chrome trace of the last step (rank r > 0 adds "
                         ".rankR); its folder must exist")
    ap.add_argument("--data", type=Path, default=d.data,
                    help="train a text model on this WikiText-format file (vocabulary built "
                         "from it)")
    ap.add_argument("--eval", type=Path, default=d.eval,
                    help="held-out WikiText-format file: print its perplexity after training")
    ap.add_argument("--eval-batches", type=int, default=d.eval_batches,
                    help="batches of --eval to score")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default=d.precision,
                    help="bf16: mixed precision, each op under torch.autocast in bfloat16, its "
                         "output in the dtype autocast gives it, as in eager PyTorch (weights, "
                         "their gradients and the optimizer stay float32)")
    ap.add_argument("--timeout", type=float, default=d.timeout,
                    help="seconds a collective may wait for a lost or stuck peer before the run "
                         "stops with an error (default 300)")
    ap.add_argument("--checkpoint", type=Path, default=d.checkpoint,
                    help="folder for checkpoints (torch.distributed.checkpoint, one step{S} "
                         "folder; latest.json names the last complete one)")
    ap.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="N",
                    help="write a checkpoint every N steps (needs --checkpoint)")
    ap.add_argument("--resume", action="store_true",
                    help="go on from the last checkpoint in --checkpoint: the same --model, "
                         "--batch, --seed and --optimizer as the run that wrote it; --strategy, "
                         "--micro-batches and the number of ranks may change. The losses are "
                         "those of an uninterrupted run")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return ap


def parse_args(argv=None) -> TrainOptions:
    """The options of the command line `argv` (the process's own if None); a bad flag exits
    (code 2) with one line naming it."""
    ap = parser()
    args = TrainOptions(**vars(ap.parse_args(argv)))
    _check(ap, args)
    return args


def _check(ap: Parser, args: TrainOptions) -> None:
    """What argparse does not check; makes the --checkpoint folder a run will write in."""
    if (args.checkpoint_every is not None or args.resume) and args.checkpoint is None:
        ap.error("--checkpoint-every and --resume need --checkpoint FOLDER")
    if args.eval is not None and args.data is None:
        ap.error("--eval needs --data (the vocabulary comes from the training file)")
    ap.at_least_one(args, "steps", "batch", "micro_batches", "threads", "eval_batches",
                    "checkpoint_every", "nproc_per_node")
    if not (args.timeout > 0 and math.isfinite(args.timeout)):
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
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
