"""Shared fixtures: tiny models captured once, and runners for functions on N gloo ranks and
for work in worker processes beside them."""
from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hidup.graph.capture import capture
from hidup.models import get_model


def one_line(main, argv, capsys, code: int | None = None) -> str:
    """Run a command's main; it must fail (with exit `code`, where given) and print exactly one
    line on stderr: that line."""
    capsys.readouterr()
    try:
        got = main(argv)
    except SystemExit as stop:
        got = stop.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert got not in (0, None) and (code is None or got == code), (argv, got, err)
    assert len(err) == 1, (argv, err)
    return err[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, fn, args, out_dir):
    faulthandler.enable()  # a rank that aborts prints where it was (every thread's stack)
    torch.set_num_threads(1)
    # the ranks meet in a file, not at a TCP store hosted by rank 0 (torchrun keeps the store out
    # of the ranks too, in its agent, as hidup.runtime.launch does)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}",
                            rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
        dist.barrier()  # no rank tears down while another still works
    finally:
        dist.destroy_process_group()


# The ranks are forked from a server process that has imported torch and HiDup once and captured
# a model (the 'forkserver' start method, its preload set before the server starts;
# tests/rank_preload.py): a rank starts in a fraction of a second instead of importing them anew
# as a spawned process does, and its first capture does not import torch.export's ~700 modules
# again (seconds, times every rank of every test on two cores). The server itself starts no
# thread, so a fork of it is as clean as a spawned process.
_PRELOAD = ["torch", "torch.distributed", "hidup", "hidup.api", "hidup.runtime.execute",
            "hidup.planning.search", "rank_preload"]
_TESTS = os.path.dirname(os.path.abspath(__file__))


@contextmanager
def _tests_importable():
    """tests/ on PYTHONPATH while the server may start: Python 3.11's forkserver does not take
    the parent's sys.path (it ignores the sys_path it is given), and silently skips a preload
    it cannot import."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, before) if p)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


def _task(index, fn, units, args, out_dir):
    """A worker of start_workers: {unit's index: fn(unit, *args)} of the units it claims, each
    claimed by the first worker free to take it (a file made once), in order."""
    faulthandler.enable()
    torch.set_num_threads(1)  # beside the other workers and ranks, on few cores
    done = {}
    for i, unit in enumerate(units):
        try:
            os.close(os.open(os.path.join(out_dir, f"unit-{i}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        done[i] = fn(unit, *args)
    torch.save(done, os.path.join(out_dir, f"{index}.pt"))


class Started:
    """Processes forked from the server (start_ranks, start_workers), running while the test
    goes on: `results()` waits for them and gives each one's result, in order; leaving the
    `with` block ends any still running (the test failed before it asked)."""

    def __init__(self, count: int, worker, args: tuple):
        mp.set_forkserver_preload(_PRELOAD)
        self._dir = tempfile.TemporaryDirectory()
        self.count = count
        self._context = None
        if not count:
            return
        with _tests_importable():
            self._context = mp.start_processes(worker, args=(*args, self._dir.name),
                                               nprocs=count, join=False,
                                               start_method="forkserver")

    def results(self) -> list:
        while self._context is not None and not self._context.join():
            pass
        return [torch.load(os.path.join(self._dir.name, f"{i}.pt")) for i in range(self.count)]

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        for process in self._context.processes if self._context is not None else ():
            if process.is_alive():
                process.terminate()
            process.join()
        self._dir.cleanup()


def start_ranks(world: int, fn, *args) -> Started:
    """Start `fn(rank, world, *args)` on `world` gloo ranks (processes forked from a server
    that has imported torch and HiDup)."""
    return Started(world, _worker, (world, fn, args))


def run_ranks(world: int, fn, *args) -> list:
    """Run `fn(rank, world, *args)` on `world` gloo ranks; return each result."""
    with start_ranks(world, fn, *args) as ranks:
        return ranks.results()


class Workers(Started):
    """start_workers' processes: `results()` gives fn's result for each unit, in order."""

    def results(self) -> list:
        done = {i: r for hand in super().results() for i, r in hand.items()}
        return [done[i] for i in range(len(done))]


def start_workers(fn, units: list, *args) -> Workers:
    """Start `fn(unit, *args)` for each unit in processes forked from the server (no process
    group), one per core, each taking the next unit not taken yet: work that holds the
    interpreter's lock (ranks on threads, tiny models) on every core instead of one."""
    return Workers(min(len(units), os.cpu_count() or 1), _task, (fn, units, args))


def by_model(cases) -> list[list]:
    """The cases (model NAME, ...) grouped by model (its graph is captured once where they
    run), the most cases first."""
    groups: dict = {}
    for case in cases:
        groups.setdefault(case[0], []).append(case)
    return sorted(groups.values(), key=len, reverse=True)


def ranks_and_workers(world: int, traced: tuple, untraced: tuple, meanwhile=None) -> tuple:
    """Per rank {case: result} of two kinds of runs at once: `traced` = (fn, cases, *args) as
    fn(rank, world, cases, *args) on `world` gloo ranks, and `untraced` = (fn, cases, *args) as
    fn(a model's cases, world, *args) -> per rank {case: result}, in worker processes
    (start_workers, by_model); with meanwhile()'s result, run here while they work."""
    fn, cases, *args = traced
    local, rest, *local_args = untraced
    with start_workers(local, by_model(rest), world, *local_args) as workers, \
            start_ranks(world, fn, cases, *args) if cases else nullcontext() as ranks:
        extra = meanwhile() if meanwhile is not None else None
        out = ranks.results() if cases else [{} for _ in range(world)]
        for per_rank in workers.results():
            for rank, results in enumerate(per_rank):
                out[rank].update(results)
    return out, extra


@pytest.fixture(scope="session")
def tiny_graphs():
    """name -> (spec, model, graph) for the tiny test models."""
    out = {}
    for name in ("mlp:tiny", "gpt:tiny"):
        spec = get_model(name)
        torch.manual_seed(0)
        model = spec.build()
        out[name] = (spec, model, capture(model, spec.inputs(spec.batch, torch.Generator())))
    return out


def turned(strategy):
    """A 2-D strategy data parallel over the other axis of the mesh turned around: the same
    data-parallel parts and row size, its rows now one GPU of every machine (the machines'
    count and size swapped)."""
    from dataclasses import replace

    from hidup.strategy import Mesh
    mesh = strategy.mesh
    dp = (mesh.split_axis(strategy.dp),)
    return replace(strategy, mesh=Mesh(mesh.shape[::-1], mesh.names), dp=dp,
                   across_axes=dp if strategy.across else ())


def build_model(spec, seed: int = 0) -> torch.nn.Module:
    """The model with its initial weights, LayerNorm affine weights randomised too (at their
    default 1 and 0 a loss such as switch-trace's sum of a LayerNorm output is zero in exact
    arithmetic, and comparing rounding noise says nothing)."""
    torch.manual_seed(seed)
    model = spec.build()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
    return model


# ops whose output shares its input's storage, as the traced step records them
VIEW_OPS = ("detach", "t", "transpose", "permute", "view", "_unsafe_view", "reshape", "expand",
            "alias", "as_strided", "slice", "select", "unsqueeze", "squeeze")


def read_by(gm, made_by: set[int], readers: set[int]) -> tuple[set, list]:
    """In a traced step, the graph nodes of the tasks `made_by` (with the views of them, which
    share their memory), and the nodes of the tasks `readers` that read any of them."""
    def task(node):
        return node.meta.get("custom", {}).get("task")
    made = {n for n in gm.graph.nodes if task(n) in made_by}
    for n in gm.graph.nodes:
        if n.all_input_nodes and n.all_input_nodes[0] in made and \
                str(n.target).split(".")[-2:-1] in [[v] for v in VIEW_OPS]:
            made.add(n)
    read = [n for n in gm.graph.nodes if task(n) in readers
            and any(a in made for a in n.all_input_nodes)]
    return made, read
