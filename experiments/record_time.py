"""How long recording the traced step takes (the first step's cost, once per run), HiDup's recorder
(hidup.runtime.record) against torch's make_fx on the same step, side by side in one run:

    python -m experiments.record_time --models gpt:tiny gpt:small --strategy megatron

Each model is built as the zoo makes it for --gpus ranks, captured, planned with the fixed
--strategy and lowered with --micro-batches; rank 0's step (its collectives stood in by local
copies: nothing is sent while recording) is recorded by each tool in turns, --rounds times after one untimed round. It
prints each tool's median seconds, the graph's nodes and make_fx's median over the recorder's.
Both record the same ops (tests/test_record.py)."""
from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from hidup.cli import Parser
from hidup.graph.capture import capture
from hidup.models import get_model
from hidup.program import lower
from hidup.runtime.execute import Executor
from hidup.runtime.passes import simplify
from hidup.runtime.record import record
from hidup.runtime.step import untraced_step
from hidup.strategy import FIXED, fixed_strategy

PROG = "python -m experiments.record_time"


def _by_make_fx(step, args) -> torch.fx.GraphModule:
    """make_fx's recording, with its detaches dropped as the recorder drops them."""
    with fx_traceback.preserve_node_meta():
        gm = make_fx(step, tracing_mode="fake")(*args)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.detach.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    simplify(gm)
    return gm


def _by_record(step, args) -> torch.fx.GraphModule:
    gm = record(step, *args)
    simplify(gm)
    return gm


def measure(name: str, strategy_name: str, gpus: int, k: int, rounds: int) -> dict:
    spec = get_model(name, gpus=gpus)
    torch.manual_seed(0)
    model = spec.build()
    inputs = list(spec.inputs(spec.batch, torch.Generator().manual_seed(0)))
    graph = capture(model, inputs)
    strategy = fixed_strategy(strategy_name, graph, gpus)
    program = lower(graph, strategy, gpus, k, name)
    ex = Executor(graph, strategy, program, dict(model.named_parameters()), rank=0,
                  buffers=dict(model.named_buffers()), local_collectives=True)
    args = [*ex.params.values(), *ex.buffers, *inputs, ex.lr]
    seconds = {"make_fx": [], "record": []}
    nodes = {}
    for round_ in range(rounds + 1):  # the first round warms up (imports, caches) untimed
        for tool, how in (("make_fx", _by_make_fx), ("record", _by_record)):
            step = untraced_step(ex.spec, len(ex.params), len(ex.buffers))
            start = time.perf_counter()
            gm = how(step, args)
            if round_:
                seconds[tool].append(time.perf_counter() - start)
            nodes[tool] = len(gm.graph.nodes)
    if nodes["make_fx"] != nodes["record"]:
        raise RuntimeError(f"{name}: make_fx recorded {nodes['make_fx']} graph nodes and the "
                           f"recorder {nodes['record']}: they should record the same step")
    med = {tool: statistics.median(s) for tool, s in seconds.items()}
    return {"model": name, "strategy": strategy_name, "k": k, "gpus": gpus, "nodes": nodes,
            "make_fx_s": med["make_fx"], "record_s": med["record"],
            "ratio": med["make_fx"] / med["record"]}


def main(argv=None) -> int:
    p = Parser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--models", nargs="+", default=["gpt:tiny", "gpt:small"],
                   help="zoo models (default gpt:tiny gpt:small)")
    p.add_argument("--strategy", default="megatron", choices=sorted(FIXED),
                   help="the fixed strategy planned (default megatron)")
    p.add_argument("--gpus", type=int, default=2, help="ranks the plan is made for (default 2)")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="micro-batches per step, k (default 2: Duplex)")
    p.add_argument("--rounds", type=int, default=3,
                   help="recordings per tool, taken in turns; the median counts (default 3)")
    args = p.parse_args(argv)
    p.at_least_one(args, "gpus", "micro_batches", "rounds")
    for name in args.models:  # every name known before anything runs
        try:
            get_model(name, gpus=args.gpus)
        except (KeyError, ValueError) as exc:
            p.error(f"--models {name}: {exc}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.strategy}, "
          f"k={args.micro_batches}, rank 0 of {args.gpus}, median of {args.rounds}")
    print("| model | graph nodes | make_fx (s) | hidup.runtime.record (s) | make_fx / record |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in args.models:
        r = measure(name, args.strategy, args.gpus, args.micro_batches, args.rounds)
        print(f"| {name} | {r['nodes']['record']} | {r['make_fx_s']:.2f} | {r['record_s']:.2f} "
              f"| {r['ratio']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
