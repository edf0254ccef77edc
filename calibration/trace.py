"""Read PyTorch-profiler Chrome traces (gzip JSON or JSON): per profiled step, the wall time, the
GPU computation, the communication (NCCL kernels and device-to-device copies) and the share of
communication hidden under computation, as the paper's Table III defines them."""
from __future__ import annotations

import gzip
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from hidup.cli import Parser
from simulator.intervals import covered, union


class TraceError(ValueError):
    """A trace file is missing, unreadable or not a PyTorch-profiler Chrome trace."""


@dataclass(frozen=True)
class StepBreakdown:
    wall: float  # seconds
    computation: float
    communication: float
    overlap: float  # share of communication under computation

    def __str__(self) -> str:
        return (f"step {self.wall * 1e3:.1f} ms: computation {self.computation * 1e3:.1f} ms, "
                f"communication {self.communication * 1e3:.1f} ms, overlap {self.overlap:.0%}")


def load_trace(path: Path) -> list[dict]:
    """The trace's events; a missing or corrupt file is a one-line TraceError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
        text = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        doc = json.loads(text)
    except (OSError, EOFError, gzip.BadGzipFile, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {path}: cannot read it ({exc}); give a PyTorch-profiler Chrome "
                         f"trace (.json or .json.gz)") from exc
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        raise TraceError(f"trace {path}: no \"traceEvents\" list; not a Chrome trace")
    return events


# the device's work as the profiler names it: PyTorch 1.x ("Kernel", "Memcpy", the V100 traces)
# and 2.x ("kernel", "gpu_memcpy", the H100 traces); memsets are left out as they always were
KERNELS, COPIES = {"Kernel", "kernel"}, {"Memcpy", "gpu_memcpy"}


def is_nccl(event: dict) -> bool:
    return event.get("name", "").startswith(("ncclKernel", "ncclDevKernel"))


def is_communication(event: dict) -> bool:
    """An NCCL kernel, or a device-to-device copy (communication in the multi-GPU traces)."""
    return is_nccl(event) or (event.get("cat") in COPIES and "DtoD" in event.get("name", ""))


def gpu_events(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in KERNELS | COPIES]


def steps(events: list[dict]) -> list[dict]:
    """The host's ProfilerStep# ranges (PyTorch 2.x also marks each on the device, as a
    gpu_user_annotation; those are not steps of their own)."""
    found = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"]
    if not found:
        raise TraceError("the trace has no ProfilerStep# ranges; profile with a schedule "
                         "(torch.profiler.schedule) so that steps are marked")
    return sorted(found, key=lambda e: e["ts"])


def step_gpu_events(events: list[dict]) -> list[list[dict]]:
    """Per profiled step, its GPU events in time order: those starting between the step's mark
    and the next one (the last step: its own end)."""
    marks = steps(events)
    gpu = sorted(gpu_events(events), key=lambda e: e["ts"])
    out = []
    for i, step in enumerate(marks):
        end = marks[i + 1]["ts"] if i + 1 < len(marks) else step["ts"] + step["dur"]
        out.append([e for e in gpu if step["ts"] <= e["ts"] < end])
    return out


# the optimizer a traced step ran, by the name PyTorch's profiler gives its step
# ('Optimizer.step#SGD.step'; DeepSpeed's 'FusedAdam' is Adam's update in fewer kernels) -> its
# name in hidup.program.OPTIMIZERS; SGD with a momentum buffer multiplies it first (a mul op)
OPTIMIZER_NAMES = {"SGD": "sgd", "Adam": "adam", "FusedAdam": "adam", "AdamW": "adamw",
                   "FusedAdamW": "adamw"}


@dataclass(frozen=True)
class TracedUpdate:
    optimizer: str  # a name in hidup.program.OPTIMIZERS
    seconds: float  # the GPU time of its kernels per step (mean over the profiled steps)
    kernels: int  # kernels per step


def traced_update(events: list[dict]) -> TracedUpdate | None:
    """The optimizer whose step the trace records (an `Optimizer.step#NAME.step` range) and its
    kernels' GPU time per step; None where the trace names no optimizer step (the H100 traces,
    whose optimizer only their README names). An optimizer HiDup does not price is a
    TraceError."""
    ranges = [e for e in events if e.get("cat") == "cpu_op" and e.get("ph", "X") == "X"
              and str(e.get("name", "")).startswith("Optimizer.step#")]
    if not ranges:
        return None
    torch_name = ranges[0]["name"].removeprefix("Optimizer.step#").split(".")[0]
    if torch_name not in OPTIMIZER_NAMES:
        raise TraceError(f"the trace's optimizer {torch_name} ({ranges[0]['name']}) is not one "
                         f"HiDup prices ({', '.join(OPTIMIZER_NAMES)})")
    kernels: dict[object, list[float]] = {}  # external id -> the durations of its kernels
    for e in events:
        if e.get("cat") in KERNELS:
            kernels.setdefault(external_id(e), []).append(e["dur"] * 1e-6)
    cpu = [e for e in events if e.get("cat") == "cpu_op"]
    ops, launched = set(), []
    for step in ranges:
        inside = [e for e in cpu if e.get("tid") == step["tid"]
                  and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
        ops |= {e["name"] for e in inside}
        launched += [d for e in inside for d in kernels.get(external_id(e), ())]
    name = OPTIMIZER_NAMES[torch_name]
    if name == "sgd" and any("mul" in op for op in ops):
        name = "sgd-momentum"
    return TracedUpdate(name, sum(launched) / len(ranges), round(len(launched) / len(ranges)))


def external_id(event: dict):
    """The id that joins a host op to the kernels it launched (PyTorch 1.x spells it 'external
    id' on a kernel, 2.x 'External id')."""
    args = event.get("args", {})
    return args.get("External id", args.get("external id"))


def breakdown(events: list[dict]) -> StepBreakdown:
    """Mean over the profiled steps of wall time, computation, communication and overlap."""
    per_step = step_gpu_events(events)
    # one GPU (no NCCL kernel anywhere): a device-to-device copy is the model's own work
    nccl = any(is_nccl(e) for step in per_step for e in step)
    talks = is_communication if nccl else (lambda e: False)
    rows = []
    for step, inside in zip(steps(events), per_step):
        comm = [(e["ts"], e["ts"] + e["dur"]) for e in inside if talks(e)]
        comp = union([(e["ts"], e["ts"] + e["dur"]) for e in inside if not talks(e)])
        computation = sum(b - a for a, b in comp)  # busy time: two streams count once
        communication = sum(b - a for a, b in comm)
        hidden = sum(covered(a, b, comp) for a, b in comm)
        rows.append((step["dur"], computation, communication, hidden))
    wall, computation, communication, hidden = (statistics.fmean(c) for c in zip(*rows))
    return StepBreakdown(wall * 1e-6, computation * 1e-6, communication * 1e-6,
                         hidden / communication if communication else 0.0)


def main(argv=None) -> int:
    """`python -m calibration.trace TRACE...`: the step breakdown of each trace."""
    import sys
    ap = Parser(prog="python -m calibration.trace", description=__doc__)
    ap.add_argument("traces", nargs="+", type=Path, help="PyTorch-profiler Chrome traces")
    args = ap.parse_args(argv)
    try:
        for path in args.traces:
            print(f"{path}: {breakdown(load_trace(path))}")
    except TraceError as exc:
        print(f"python -m calibration.trace: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
