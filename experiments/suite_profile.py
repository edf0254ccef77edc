"""Where the test suite's CPU time goes: a py-spy profile of the whole suite (every process it
starts: gloo ranks, `torchrun` launches, commands run as subprocesses) summed by what the stacks
were doing and by the kind of process, as two Markdown tables of CPU seconds. Record it alone
(the sampler slows the suite a little):

    CI=true py-spy record --subprocesses --nonblocking --rate 20 --format raw -o suite.raw -- \\
        python -m pytest -q -p no:cacheprovider
    python -m experiments.suite_profile suite.raw [--rate 20]

A sample counts under the first kind of work its stack shows, in WORK's order (an import
anywhere in a stack makes it import time, whatever the imported module runs)."""
from __future__ import annotations

import re
import sys
from collections import Counter

from hidup.cli import Parser

PROG = "python -m experiments.suite_profile"
# (what, a pattern of the stack's frames), most telling first
WORK = (
    ("module imports", r"_find_and_load|<frozen importlib"),
    ("recording a training step (hidup.runtime.step.trace_step)", r"trace_step"),
    ("capture (torch.export, hidup.graph.capture)", r"torch/export/|hidup/graph/capture\.py"),
    ("what autograd saves (hidup.graph.saved's probes)", r"hidup/graph/saved\.py"),
    ("other make_fx / FakeTensor work", r"make_fx|proxy_tensor\.py|fake_tensor\.py"),
    ("the search's dynamic programme", r"hidup/planning/(programme|beam|pricing)\.py"),
    ("lowering (hidup.program)", r"hidup/program/"),
    ("estimate and memory model", r"hidup/planning/(estimate|memory|fusion)\.py"),
    ("the SimPy simulator", r"simulator/"),
    ("steps run (hidup.runtime)", r"hidup/runtime/"),
    ("calibration", r"calibration/"),
)
_COMPILED = tuple((what, re.compile(pattern)) for what, pattern in WORK)


def read(path: str) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) lines: (frames, samples) each."""
    out = []
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if count.isdigit() and stack:
                out.append((stack.split(";"), int(count)))
    return out


def work_of(frames: list[str]) -> str:
    stack = ";".join(frames)
    return next((what for what, rx in _COMPILED if rx.search(stack)), "other")


def process_of(frames: list[str]) -> str:
    """The kind of process a stack is from: the test process itself (and its ranks on
    threads), a gloo rank the tests start (forked from their forkserver), the module a command
    runs (`-m NAME`), a script, or `python -c`."""
    command = ([f for f in frames if f.startswith("process ")][-1:] or [""])[0]
    if "multiprocessing.forkserver" in command:
        return "the tests' gloo ranks (forked from their forkserver)"
    module = re.search(r" -m ([\w.]+)", command)
    if module is not None:
        return "pytest (and ranks on its threads)" if module.group(1) == "pytest" \
            else f"`python -m {module.group(1)}`"
    script = re.search(r"(\S+\.py)(?=[\s\"]|$)", command)
    return script.group(1).rsplit("/", 1)[-1] if script else "`python -c`"


def table(counts: Counter, total: int, rate: float, head: str) -> str:
    lines = [f"| {head} | CPU s | share |", "| --- | ---: | ---: |"]
    lines += [f"| {what} | {n / rate:.1f} | {n / total:.1%} |" for what, n in counts.most_common()]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = Parser(prog=PROG, description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("raw", help="py-spy's --format raw output of the whole suite")
    p.add_argument("--rate", type=float, default=20.0,
                   help="the samples per second it was recorded at (default 20)")
    args = p.parse_args(argv)
    try:
        samples = read(args.raw)
    except OSError as exc:
        p.error(f"{args.raw}: {exc.strerror}")
    if not samples:
        p.error(f"{args.raw}: no py-spy raw samples in it (record with --format raw)")
    total = sum(n for _, n in samples)
    by_work, by_process = Counter(), Counter()
    for frames, n in samples:
        by_work[work_of(frames)] += n
        by_process[process_of(frames)] += n
    print(f"{total} samples, {total / args.rate:.1f} CPU s\n")
    print(table(by_work, total, args.rate, "work") + "\n")
    print(table(by_process, total, args.rate, "process"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
