"""Read a PyTorch-profiler Chrome trace and report how much of its communication ran under
computation: `python -m experiments.trace_overlap TRACE`.

A trace with NCCL kernels on the device (a multi-GPU CUDA run: the V100 traces in shared/traces,
or `hidup.train --trace` on GPUs) is read on the device's timeline: each NCCL kernel is a
collective, hidden where a computation kernel of the same device ran beside it (the split of
calibration.trace; micro-batches are not told apart). A CPU run of `hidup.train --trace` (gloo)
is read through HiDup's labels: each collective, and how much of it ran while another
micro-batch was computing. A trace with neither, or one that cannot be read, is an error."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from calibration.trace import (TraceError, breakdown, gpu_events, is_communication, is_nccl,
                               load_trace)
from hidup.cli import Parser
from simulator.intervals import covered, union

PROG = "python -m experiments.trace_overlap"

_ISSUE = re.compile(r"^(all_gather|all_reduce|reduce_scatter|all_to_all) (\S+)(?: mb(\d+))?$")
_COMPUTE = re.compile(r"^(fwd|bwd) (\S+) mb(\d+)$")


@dataclass(frozen=True)
class Overlap:
    collective: str  # our label, e.g. 'all_reduce linear_1 mb0'
    mb: int | None
    start_us: float
    end_us: float
    hidden_us: float  # time of this collective during computation of another micro-batch

    def __str__(self) -> str:
        return (f"{self.collective}: {self.end_us - self.start_us:.0f} us, "
                f"{self.hidden_us:.0f} us under another micro-batch's compute")


def load_events(path: Path) -> list[dict]:
    """The trace's complete events ("ph": "X"); a bad file raises TraceError."""
    return [e for e in load_trace(path) if e.get("ph") == "X"]


def overlaps(events: list[dict]) -> list[Overlap]:
    """Match each gloo/nccl kernel to the HiDup label that issued it (the last one issued before
    the kernel started: the communication thread may start it after the label has ended, once
    the collective before it is done), then intersect its span with the compute labels of other
    micro-batches."""
    issues = sorted((e for e in events if _ISSUE.match(e["name"])), key=lambda e: e["ts"])
    kernels = [e for e in events if re.match(r"^(gloo|nccl):", e["name"])
               and "barrier" not in e["name"]]
    computes = [(e["ts"], e["ts"] + e["dur"], int(_COMPUTE.match(e["name"]).group(3)))
                for e in events if _COMPUTE.match(e["name"])]
    out = []
    for i, issue in enumerate(issues):
        until = issues[i + 1]["ts"] if i + 1 < len(issues) else float("inf")
        inside = [k for k in kernels if issue["ts"] <= k["ts"] < until]
        if not inside:
            continue
        start = min(k["ts"] for k in inside)
        end = max(k["ts"] + k["dur"] for k in inside)
        mb_text = _ISSUE.match(issue["name"]).group(3)
        mb = None if mb_text is None else int(mb_text)
        hidden = sum(max(0.0, min(end, ce) - max(start, cs)) for cs, ce, cm in computes
                     if mb is not None and cm != mb)
        out.append(Overlap(issue["name"], mb, start, end, hidden))
    return out


def kernel_overlaps(events: list[dict]) -> list[Overlap]:
    """Each NCCL kernel on the device ('nccl AllReduce', ...) and how much of it ran while a
    computation kernel of the same device ran (every kernel or copy that calibration.trace does
    not count as communication)."""
    gpu = gpu_events(events)
    out = []
    for device in sorted({e.get("pid") for e in gpu}, key=str):
        mine = [e for e in gpu if e.get("pid") == device]
        busy = union([(e["ts"], e["ts"] + e["dur"]) for e in mine if not is_communication(e)])
        for e in sorted((e for e in mine if is_nccl(e)), key=lambda e: e["ts"]):
            start, end = e["ts"], e["ts"] + e["dur"]
            parts = e["name"].split("(")[0].split("_")  # ncclKernel_AllReduce_RING_LL_...
            kind = parts[1] if len(parts) > 1 else parts[0]
            out.append(Overlap(f"nccl {kind}", None, start, end, covered(start, end, busy)))
    return out


def report_kernels(found: list[Overlap], events: list[dict]) -> list[str]:
    """Per kind of NCCL kernel, and in all; then calibration.trace's mean step, if marked."""
    lines = []
    for kind in sorted({o.collective for o in found}):
        mine = [o for o in found if o.collective == kind]
        total = sum(o.end_us - o.start_us for o in mine)
        hidden = sum(o.hidden_us for o in mine)
        lines.append(f"{kind}: {len(mine)} kernels, {total / 1e3:.2f} ms, {hidden / 1e3:.2f} ms "
                     f"under computation ({hidden / total if total else 0:.0%})")
    total = sum(o.end_us - o.start_us for o in found)
    hidden = sum(o.hidden_us for o in found)
    lines.append(f"{len(found)} collectives (NCCL kernels), {total / 1e3:.2f} ms, "
                 f"{hidden / 1e3:.2f} ms of it under computation: overlap "
                 f"{hidden / total if total else 0:.0%} (micro-batches not told apart)")
    try:
        lines.append(f"mean profiled step (calibration.trace): {breakdown(events)}")
    except TraceError:  # no ProfilerStep# marks: the totals above are the whole trace
        pass
    return lines


def main(argv=None) -> int:
    ap = Parser(prog=PROG, description=__doc__)
    ap.add_argument("trace", type=Path,
                    help="PyTorch-profiler Chrome trace (.json or .json.gz), e.g. one written by "
                         "hidup.train --trace")
    args = ap.parse_args(argv)
    try:
        events = load_events(args.trace)
        if any(is_nccl(e) for e in gpu_events(events)):
            found = kernel_overlaps(events)
            lines = report_kernels(found, events)
        else:
            found = overlaps(events)
            total = sum(o.end_us - o.start_us for o in found)
            hidden = sum(o.hidden_us for o in found)
            lines = [str(o) for o in found] + [
                f"{len(found)} collectives, {total / 1e3:.2f} ms, {hidden / 1e3:.2f} ms of it "
                f"during another micro-batch's computation"]
    except TraceError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError, AttributeError) as exc:
        print(f"{PROG}: error: trace {args.trace}: an event is malformed ({exc!r}); give a "
              f"PyTorch-profiler Chrome trace", file=sys.stderr)
        return 2
    if not found:
        print(f"{PROG}: error: trace {args.trace}: no collectives in it (no NCCL kernels, no "
              f"gloo/nccl collective under a HiDup label); give the trace of a multi-rank run, "
              f"e.g. torchrun --nproc-per-node 2 -m hidup.train --duplex --trace T",
              file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
