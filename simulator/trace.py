"""Chrome trace of a simulated step, laid out like a PyTorch profiler trace: one process per rank,
one track per CUDA stream ('stream 0 (compute)', 'stream 1 (nccl)'; a second track for the
collectives in flight beside another, as gloo's two threads run them) and, where the profile has
host figures, the host thread that issues the tasks ('host'); complete events in us."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from hidup.program import Compute, Convert, task_label
from simulator.records import HOST, Record, Result

log = logging.getLogger(__name__)


def event_args(task: Compute | Convert) -> dict:
    """What the trace shows for a task when it is selected."""
    args = {"task": task.id, "phase": task.phase, "micro-batch": task.mb, "bytes": task.bytes}
    if isinstance(task, Compute):
        args.update(op=task.op, flops=task.flops, option=str(task.option or ""))
    else:
        args.update(kind=task.kind, placement=f"{task.src} -> {task.dst}",
                    group=list(task.group))
    return args


def chrome_trace(result: Result, title: str = "") -> dict:
    """The `traceEvents` document of a simulated step (all ranks)."""
    events = []
    for rank, records in enumerate(result.records):
        events += _metadata(rank, records, result.comm_stream, title)
        events += [_complete(rank, r) for r in records]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: Path, result: Result, title: str = "") -> None:
    """Write the Chrome trace (open it in chrome://tracing or Perfetto)."""
    doc = chrome_trace(result, title)
    Path(path).write_text(json.dumps(doc) + "\n")
    log.info("wrote %d trace events to %s", len(doc["traceEvents"]), path)


LANE_TID = 10  # a collective in flight beside others: track LANE_TID + its lane


def _tid(record: Record) -> int:
    return LANE_TID + record.lane if record.lane else record.stream


def _track(tid: int, comm_stream: int) -> str:
    if tid == HOST:
        return "host (issues the tasks)"
    if tid > LANE_TID:
        return f"stream {comm_stream} (nccl), collective {tid - LANE_TID + 1} in flight"
    return f"stream {tid} ({'nccl' if tid == comm_stream else 'compute'})"


def _metadata(rank: int, records: tuple[Record, ...], comm_stream: int, title: str) -> list[dict]:
    name = f"rank {rank}" + (f" {title}" if title else "")
    out = [{"ph": "M", "name": "process_name", "pid": rank, "args": {"name": name}},
           {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
    for tid in sorted({_tid(r) for r in records} | {0, comm_stream}):
        out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                    "args": {"name": _track(tid, comm_stream)}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                    "args": {"sort_index": tid}})
    return out


def _complete(rank: int, record: Record) -> dict:
    return {"ph": "X", "cat": "cpu_op" if record.stream == HOST else "kernel",
            "name": task_label(record.task), "pid": rank,
            "tid": _tid(record), "ts": record.start * 1e6, "dur": record.duration * 1e6,
            "args": {"stream": record.stream, **event_args(record.task)}}
