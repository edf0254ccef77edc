"""Read a torch.profiler Chrome trace of `hidup.train --trace` and report, per collective, how much
of it ran while another micro-batch was computing: `python -m experiments.trace_overlap TRACE`."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from calibration.trace import TraceError, load_trace
from hidup.cli import Parser

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


def main(argv=None) -> int:
    ap = Parser(prog="python -m experiments.trace_overlap", description=__doc__)
    ap.add_argument("trace", type=Path, help="Chrome trace written by hidup.train --trace")
    args = ap.parse_args(argv)
    try:
        found = overlaps(load_events(args.trace))
    except TraceError as exc:
        print(f"python -m experiments.trace_overlap: error: {exc}", file=sys.stderr)
        return 2
    for o in found:
        print(o)
    total = sum(o.end_us - o.start_us for o in found)
    hidden = sum(o.hidden_us for o in found)
    print(f"{len(found)} collectives, {total / 1e3:.2f} ms, {hidden / 1e3:.2f} ms of it during "
          f"another micro-batch's computation")
    return 0


if __name__ == "__main__":
    sys.exit(main())
