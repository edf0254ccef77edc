"""What simulator.predict reports: a Prediction (one strategy simulated as plain SPMD and with
Duplex, with peak memory and optional Monte-Carlo intervals) and a Comparison (the searched plan
beside the fixed strategies, and the one to run), each as text lines and as a JSON-ready dict."""
from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass

from hidup.cli import number
from hidup.graph.capture import Graph
from hidup.planning.costs import Profile
from hidup.planning.memory import MemoryReport
from hidup.strategy import Strategy, describe, summarize
from simulator.montecarlo import Interval
from simulator.records import Result

# rank 0's step: computation + exposed communication + idle (neither stream busy: the host
# issuing tasks, or a wait for another rank) = step, where no two collectives run at once
COLUMNS = ("step (ms)", "computation (ms)", "communication (ms)", "overlap", "exposed comm (ms)",
           "idle (ms)", "peak mem (GiB)")


@dataclass(frozen=True)
class Prediction:
    """Both simulated runs of one model, cluster, world size and strategy."""

    model: str
    batch: int
    profile: Profile
    gpus: int
    strategy: Strategy
    k: int
    spmd: Result
    duplex: Result
    graph: Graph
    memory: tuple[MemoryReport, MemoryReport]  # peak memory per rank: SPMD, Duplex
    intervals: tuple[Interval, Interval] | None = None  # Monte-Carlo step times: SPMD, Duplex
    mode: str = "graph"  # the executor mode whose host cost was simulated (GPU profiles)
    show_plan: bool = False  # print every op's placements, not the summary
    optimizer: str = "adamw"  # whose update and state the runs count
    # why Duplex was not simulated, where it was not (k = 1: the batch does not split)
    notes: tuple[str, ...] = ()

    @property
    def speedup(self) -> float:
        return self.spmd.step_time / self.duplex.step_time if self.duplex.step_time else 1.0

    def runs(self) -> list[tuple[int, Result, MemoryReport]]:
        """(micro-batches, simulated step, memory) of SPMD and of Duplex."""
        return [(1, self.spmd, self.memory[0]), (self.k, self.duplex, self.memory[1])]

    def simulated(self) -> list[tuple[int, Result, MemoryReport]]:
        """The runs of `runs` that were simulated: SPMD alone where the batch does not split
        into Duplex's micro-batches (then `notes` says so)."""
        return self.runs()[:1 if self.notes else 2]

    def fits(self, memory: MemoryReport) -> bool:
        return self.profile.fits(memory.peak) is not False

    def best(self) -> tuple[int, Result] | None:
        """The faster of SPMD and Duplex among those that fit a device; None if neither does."""
        fitting = [(k, r) for k, r, m in self.runs() if self.fits(m)]
        return min(fitting, key=lambda kr: kr[1].step_time) if fitting else None

    def rows(self) -> list[tuple[str, Result, MemoryReport]]:
        """The report's runs: SPMD, and Duplex where it was simulated."""
        spmd = [("SPMD (k=1)", self.spmd, self.memory[0])]
        return spmd if self.k == 1 else spmd + [(f"Duplex (k={self.k})", self.duplex,
                                                  self.memory[1])]

    def to_dict(self) -> dict:
        return {"model": self.model, "batch": self.batch, "cluster": self.profile.name,
                "gpus": self.gpus, "strategy": self.strategy.name, "micro_batches": self.k,
                "mode": self.mode, "optimizer": self.optimizer,
                "notes": list(self.strategy.notes) + list(self.notes),
                "device_memory_bytes": self.profile.device_memory,
                "spmd": _result_dict(self.spmd, 1, self.memory[0], self.profile),
                "duplex": _result_dict(self.duplex, self.k, self.memory[1], self.profile),
                "speedup": self.speedup,
                "monte_carlo": None if self.intervals is None else
                {name: {"mean_ms": i.mean * 1e3, "low_ms": i.low * 1e3, "high_ms": i.high * 1e3,
                        "level": i.level, "samples": i.samples}
                 for name, i in zip(("spmd", "duplex"), self.intervals)},
                "plan": {"summary": summarize(self.graph, self.strategy),
                         "options": {n: str(o) for n, o in self.strategy.options.items()},
                         "placements": {n: str(p) for n, p in self.strategy.placements.items()}}}

    def __str__(self) -> str:
        head = f"{_setting(self.model, self.batch, self.profile, self.gpus, self.optimizer)}, " \
               f"strategy {self.strategy.name}"
        if self.profile.host is not None:
            head += (f", executor mode {self.mode} ({self.profile.host[self.mode] * 1e6:.3g} us "
                     f"of host time per task)")
        noise = [] if self.intervals is None else [
            f"Monte-Carlo, profile figures perturbed: SPMD {self.intervals[0]}" +
            (f"; Duplex {self.intervals[1]}" if self.k > 1 else "")]
        speedup = [f"speedup of Duplex over SPMD: {self.speedup:.3f}x"] if self.k > 1 else []
        return "\n".join([head, *_notes(self.strategy), *self.notes, "", *_table(self.rows()),
                          *speedup,
                          *self._memory_lines(), *noise, "", *self.plan_lines()])

    def _memory_lines(self) -> list[str]:
        limit = self.profile.device_memory
        over = [f"{name} needs {number(m.peak / 2**30, 3)} GiB per rank"
                for name, _, m in self.rows() if not self.fits(m)]
        if not over:
            return []
        return [f"does not fit a device's {limit / 2**30:.3g} GiB: {' and '.join(over)}; choose "
                f"more GPUs, a smaller batch, or a strategy that splits the weights"]

    def plan_lines(self) -> list[str]:
        if self.show_plan:
            return _plan_lines(self.strategy)
        return [f"plan {self.strategy.name}: {describe(self.graph, self.strategy)} "
                f"(every op's placements: --show-plan)"]


@dataclass(frozen=True)
class Comparison:
    """HiDup's searched plan and the fixed strategies, each predicted with and without Duplex,
    and the one to run, as hidup.planning.select chose it (the fastest that fits a device by the
    planner's estimate)."""

    predictions: tuple[Prediction, ...]  # the searched plan first (where the search found one)
    chosen: int  # index into predictions
    chosen_k: int
    search_seconds: float
    search_note: str = ""  # why there is no searched plan, where there is none

    def __str__(self) -> str:
        first = self.predictions[0]
        k = first.k
        lines = [_setting(first.model, first.batch, first.profile, first.gpus,
                          first.optimizer), ""]
        if self.search_note:
            lines += [self.search_note, ""]
        head = ("plan", "SPMD k=1 (ms)", f"Duplex k={k} (ms)", "Duplex gain",
                f"peak k=1 / k={k} (GiB)")
        width = max(len(head[0]), *(len(p.strategy.name) for p in self.predictions))
        lines.append(f"{head[0]:<{width}}" + "".join(f"  {h}" for h in head[1:]))
        for i, p in enumerate(self.predictions):
            peaks = [number(m.peak / 2**30, 3) for _, _, m in p.simulated()]
            cells = [_ms(p, 0), _ms(p, 1), f"{p.speedup:.3f}x", " / ".join(peaks)]
            mark = "  <- chosen" if i == self.chosen else ""
            lines.append(f"{p.strategy.name:<{width}}" + "".join(
                f"  {c:>{len(h)}}" for c, h in zip(cells, head[1:])) + mark)
        starred = any(not p.fits(m) for p in self.predictions for _, _, m in p.simulated())
        lines += ["(*: does not fit a device's memory)"] if starred else []
        lines += ["", self.why(), ""]
        chosen = self.predictions[self.chosen]
        lines += [f"{chosen.strategy.name}, simulated:", *_table(chosen.rows()),
                  *_notes(chosen.strategy), "", *chosen.plan_lines()]
        return "\n".join(lines)

    def why(self) -> str:
        """One line: what was chosen and why, against the best other plan."""
        chosen = self.predictions[self.chosen]
        k, result = chosen.best()
        duplex = f"with Duplex (k={k})" if k > 1 else "without Duplex"
        line = (f"chose {chosen.strategy.name} {duplex}: {number(result.step_time * 1e3)} ms a "
                f"step; {describe(chosen.graph, chosen.strategy)}")
        others = [(p, p.best()) for i, p in enumerate(self.predictions) if i != self.chosen]
        others = [(p, b) for p, b in others if b is not None]
        if others:
            rival, (rk, rr) = min(others, key=lambda pb: pb[1][1].step_time)
            what = f"{rival.strategy.name} {'with Duplex' if rk > 1 else 'without Duplex'}"
            if rr.step_time >= result.step_time:
                line += (f"; {rr.step_time / result.step_time:.3f}x faster than the next best, "
                         f"{what} ({number(rr.step_time * 1e3)} ms)")
            else:  # the planner ranks by its one-pass estimate; the simulator adds interference
                line += (f"; the simulator finds {what} faster ({number(rr.step_time * 1e3)} ms): "
                         f"the planner's estimate, which chose, ranks it slower")
        spmd, duplex_run = chosen.spmd, chosen.duplex
        if k > 1:
            line += (f"; Duplex hides {duplex_run.overlap_ratio:.0%} of its communication behind "
                     f"computation (SPMD {spmd.overlap_ratio:.0%})")
        elif chosen.fits(chosen.memory[1]):
            kernels = duplex_run.computation - spmd.computation
            exposed = duplex_run.exposed_communication - spmd.exposed_communication
            idle = duplex_run.idle - spmd.idle
            why = (f"its streams wait longer for the host issuing its tasks, or for other "
                   f"ranks ({idle * 1e3:+.4g} ms idle)" if idle >= max(kernels, exposed) else
                   f"its extra kernels ({kernels * 1e3:+.4g} ms) cost more than the "
                   f"communication it hides" if kernels >= exposed else
                   f"it leaves more communication exposed ({exposed * 1e3:+.4g} ms)")
            line += f"; Duplex would take {number(duplex_run.step_time * 1e3)} ms: {why}"
        return line

    def to_dict(self) -> dict:
        chosen = self.predictions[self.chosen]
        return {"model": chosen.model, "batch": chosen.batch, "cluster": chosen.profile.name,
                "gpus": chosen.gpus, "micro_batches": chosen.k, "optimizer": chosen.optimizer,
                "device_memory_bytes": chosen.profile.device_memory,
                "chosen": {"strategy": chosen.strategy.name, "k": self.chosen_k,
                           "why": self.why()},
                "search_seconds": self.search_seconds, "search_note": self.search_note or None,
                "plans": [p.to_dict() for p in self.predictions]}


def _ms(p: Prediction, i: int) -> str:
    if i >= len(p.simulated()):  # Duplex not simulated: the batch does not split so
        return "-"
    _, result, memory = p.runs()[i]
    return number(result.step_time * 1e3) + ("" if p.fits(memory) else "*")


def _setting(model: str, batch: int, profile: Profile, gpus: int, optimizer: str) -> str:
    machines, per = -(-gpus // profile.gpus_per_node), min(gpus, profile.gpus_per_node)
    where = f"{machines} machine{'s' if machines > 1 else ''} of {per}"
    memory = "" if profile.device_memory is None else \
        f", {profile.device_memory / 2**30:.3g} GiB each"
    return (f"model {model} (batch {batch}, {optimizer}), cluster {profile.name}: {gpus} GPUs, "
            f"{where}{memory}")


def _notes(strategy: Strategy) -> list[str]:
    return [f"note: {note}" for note in strategy.notes]


def _result_dict(r: Result, k: int, m: MemoryReport, profile: Profile) -> dict:
    return {"k": k, "step_time_ms": r.step_time * 1e3, "computation_ms": r.computation * 1e3,
            "communication_ms": r.communication * 1e3, "overlap_ratio": r.overlap_ratio,
            "exposed_communication_ms": r.exposed_communication * 1e3, "idle_ms": r.idle * 1e3,
            "peak_memory_bytes": m.peak, "fits": profile.fits(m.peak), "memory": asdict(m)}


def _table(rows: list[tuple[str, Result, MemoryReport]]) -> list[str]:
    width = max(len(name) for name, _, _ in rows)
    lines = [" " * width + "".join(f"  {c:>{len(c)}}" for c in COLUMNS)]
    for name, r, m in rows:
        cells = (number(r.step_time * 1e3), number(r.computation * 1e3),
                 number(r.communication * 1e3), f"{r.overlap_ratio:.1%}",
                 number(r.exposed_communication * 1e3), number(r.idle * 1e3),
                 number(m.peak / 2**30, 3))
        row = "".join(f"  {v:>{len(c)}}" for v, c in zip(cells, COLUMNS))
        lines.append(f"{name:<{width}}{row}")
    return lines


def _plan_lines(strategy: Strategy) -> list[str]:
    """One line per op node, then the parameter and input placements grouped by placement."""
    lines = [f"plan {strategy.name}: op (input placements) -> output placement"]
    lines += [f"  {name}: {option}" for name, option in strategy.options.items()]
    groups: dict[str, list[str]] = {}
    for name, p in strategy.placements.items():
        groups.setdefault(str(p), []).append(name)
    lines.append("placements of parameters, buffers and inputs:")
    for p, names in sorted(groups.items()):
        lines.append(textwrap.fill(", ".join(names), width=100, break_on_hyphens=False,
                                   initial_indent=f"  {p} ({len(names)}): ",
                                   subsequent_indent="      "))
    return lines
