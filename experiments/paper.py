"""The paper's evaluation (SoCC'22, Sec. VI) on the simulator, one command per figure or table;
each prints its table and writes FIGURE.csv and FIGURE.png to --out (default out/paper/, a
git-ignored scratch folder; the figures in docs/ are refreshed with a full run and
`--out experiments/results/paper`, which a --quick run may not use):

    python -m experiments.paper scaling        # Fig. 7: HiDup vs expert parallelism, 8-64 GPUs
    python -m experiments.paper one-machine    # Fig. 8: the same and ddp on 1-8 GPUs of a machine
    python -m experiments.paper bandwidth      # Fig. 9: 2 machines x 4 GPUs, link 1-100 Gbit/s
    python -m experiments.paper batch          # Fig. 10: 2 machines, per-GPU batch swept
    python -m experiments.paper breakdown      # Table III: wall, total, computation, communication
    python -m experiments.paper robustness     # Table IV: plans found with a wrong profile
    python -m experiments.paper search-time    # Fig. 12: search time vs layers and vs GPUs
    python -m experiments.paper convergence    # Sec. VI.H: real training, searched Duplex vs ddp
    python -m experiments.paper all            # every one of them

`--quick` runs each at a reduced size (tiny models, fewer points: what CI runs). HiDup is the
searched plan with Duplex (hidup.planning.search, two micro-batches where they pay); `expert` stands
for DeepSpeed-MoE and FastMoE (experts sharded, the rest data parallel), `ddp` for PyTorch DDP, both
as those systems run: one micro-batch. Times are simulated on the shipped V100 profiles
(hidup/profiles: fitted from the V100 traces; `v100-8x8-10gbps` has the paper's 8 machines of 8 GPUs
and 9.71 Gbit/s links; `v100-2x4` its 2 machines of 4 GPUs), except convergence, which trains for
real with torchrun on this machine."""
from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

from experiments import outputs
from experiments.paper_figures import FIGURES
from experiments.paper_plots import table, write
from hidup.cli import Parser, command_logs
from hidup.models import get_model
from hidup.planning.costs import ProfileError

log = logging.getLogger(__name__)
PROG = "python -m experiments.paper"
MODELS = ("bert-sgmoe:paper", "bert-switch:paper", "vit-sgmoe:paper", "vit-switch:paper")
QUICK_MODELS = ("bert-sgmoe:tiny", "vit-switch:tiny")
DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2" / "valid.txt"


# -- command line --------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    ap = Parser(prog=PROG, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=[*FIGURES, "all"], help="the figure or table to make")
    ap.add_argument("--quick", action="store_true",
                    help="reduced size: tiny models, fewer points (what CI runs)")
    ap.add_argument("--models", nargs="+", default=None,
                    help=f"models NAME:SIZE (default the paper's four: {', '.join(MODELS)}; "
                         f"--quick: {', '.join(QUICK_MODELS)}); breakdown and robustness take "
                         f"the first")
    ap.add_argument("--gpus", type=int, nargs="+", default=None,
                    help="GPU counts for scaling (default 8 16 32 64), one-machine (1 2 4 8) and "
                         "search-time (4 16 64 256 1024)")
    ap.add_argument("--layers", type=int, nargs="+", default=None,
                    help="search-time: layer counts (default 2 8 16 32 48; --quick 2 4)")
    ap.add_argument("--steps", type=int, default=None,
                    help="convergence: training steps per run (default 300, --quick 20)")
    ap.add_argument("--data", type=Path, default=DATA,
                    help="convergence: WikiText-format training text (default "
                         "../shared/data/wikitext-2/valid.txt)")
    ap.add_argument("--lr", type=float, default=0.3,
                    help="convergence: SGD learning rate (default 0.3: the loss falls visibly "
                         "within 300 steps)")
    ap.add_argument("--exact", type=float, default=0.0, metavar="SECONDS",
                    help="scaling, one-machine, bandwidth: also rank the integer programme's "
                         "proven best plan for plain SPMD, this long per search (default 0: "
                         "the beam alone, as the committed figures were made unless their "
                         "command says otherwise)")
    ap.add_argument("--table", action="store_true",
                    help="print the figure's table alone (Markdown, as docs/paper_evaluation.md "
                         "shows it) and write no files")
    ap.add_argument("--out", type=Path, default=outputs.default_out("paper"),
                    help="folder for FIGURE.csv and FIGURE.png (default out/paper, git-ignored; "
                         "experiments/results/paper holds the figures in docs/: refresh them "
                         "with a full run, never --quick)")
    args = ap.parse_args(argv)
    if not 0 <= args.exact < float("inf"):
        ap.error(f"--exact {args.exact}: give seconds, 0 or more")
    args.models = args.models or list(QUICK_MODELS if args.quick else MODELS)
    for model in args.models:
        try:
            get_model(model)
        except ValueError as exc:
            ap.error(f"--models {model}: {exc}")
    if args.gpus is not None:
        bad = [g for g in args.gpus if g < 1 or g & (g - 1)]
        if bad:
            ap.error(f"--gpus {bad}: GPU counts must be powers of two (1, 2, 4, ...)")
        if args.figure in ("one-machine", "all") and max(args.gpus) > 8:
            ap.error(f"--gpus {max(args.gpus)}: one machine has 8 GPUs (for one-machine and all)")
    if args.layers is not None and min(args.layers) < 1:
        ap.error(f"--layers {args.layers}: layer counts must be 1 or more")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a positive finite number, got {args.lr}; e.g. --lr 0.3")
    outputs.refuse_quick_into_results(ap, args.out, args.quick, "paper")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    command_logs(PROG, __name__, "experiments")
    names = list(FIGURES) if args.figure == "all" else [args.figure]
    started = time.perf_counter()
    for i, name in enumerate(names, 1):
        log.info("[%d/%d] %s (%.0f s so far)", i, len(names), name, time.perf_counter() - started)
        try:
            fig = FIGURES[name](args)
        except (ValueError, ProfileError, RuntimeError) as exc:
            print(f"{PROG} {name}: {exc}", file=sys.stderr)
            return 2
        if args.table:
            print(table(fig))
            continue
        args.out.mkdir(parents=True, exist_ok=True)  # only once there is a figure to write
        write(fig, args.out)
    log.info("done in %.0f s", time.perf_counter() - started)
    if not args.table:
        print(outputs.note(args.out, "paper"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
