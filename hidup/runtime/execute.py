"""The executor: runs one rank's compiled step (hidup.runtime.step) with torch.distributed (gloo on
CPU, nccl on GPU). The step is traced once per (update or not, input shapes) and then run as
generated code, as an FX graph (default), through torch.compile (Inductor), or replayed as a CUDA
graph."""
from __future__ import annotations

import logging
from dataclasses import replace

import torch
import torch.distributed as dist

from hidup.graph.capture import Graph
from hidup.graph.placement import Partial, Placement, Shard
from hidup.strategy import Mesh, Strategy
from hidup.program.tasks import MODES, Program, task_label
from hidup.runtime.passes import inductor_segments, with_hooks
from hidup.runtime.layout import param_shard
from hidup.runtime.step import INPUT_TASK, StepSpec, trace_step, untraced_step

log = logging.getLogger(__name__)


class Executor:
    """Holds this rank's parameter shards and runs one training step at a time.

    mode 'graph': the traced step as FX-generated Python (one call per ATen op, nothing else);
    'compile': the traced step through torch.compile (Inductor), collectives kept in the
    Program's order; 'cuda-graphs' (CUDA only): the traced step captured once, NCCL included,
    and replayed from static input buffers; 'untraced': the Program's tasks run one by one as
    Python, nothing traced (no first-step cost; slower steps: for checks of a step or two)."""

    def __init__(self, graph: Graph, strategy: Strategy, program: Program,
                 params: dict[str, torch.Tensor], lr: float = 0.01,
                 device: torch.device | str = "cpu", group=None,
                 buffers: dict[str, torch.Tensor] | None = None, rank: int | None = None,
                 autocast: torch.dtype | None = None, mode: str = "graph",
                 local_collectives: bool = False, local: bool = False):
        _check(program, mode, torch.device(device))
        self.g, self.s, self.p = graph, strategy, program
        self.world, self.k, self.device, self.mode = program.world, program.k, torch.device(device), mode
        self.rank = rank if rank is not None else dist.get_rank(group) if self.world > 1 else 0
        if program.mesh and group is not None:
            raise ValueError("a plan on a 2-D mesh runs on the default process group (its rows "
                             "and columns are made from it); leave group out")
        self.per_machine = program.row  # what the placements split over
        self.params = {}  # param node name -> this rank's shard (updated in place by the step)
        for node in graph.params:  # `params` whole, or with `local` this rank's shards already
            given = params[node.source].detach().to(self.device)
            self.params[node.name] = given if local else param_shard(
                given, strategy, node.name, self.rank, self.per_machine).clone()
        buffers = {**graph.constants, **(buffers or {})}
        missing = [n.source for n in graph.nodes if n.kind == "buffer" and n.source not in buffers]
        if missing:
            raise ValueError(f"the model's buffers {missing} were not given to the executor")
        self.buffers = [buffers[n.source].detach().to(self.device) for n in graph.nodes
                        if n.kind == "buffer"]
        self.lr = torch.tensor(float(lr), device=self.device)
        names = {}  # calibration.ops stands collectives in locally, with no group
        if self.world > 1 and not local_collectives:
            names = {program.grid.names: (group or dist.group.WORLD).group_name}
            if program.mesh:  # this rank's group along each axis and each set of them used
                used = {(a,) for a in program.mesh.names} | {
                    t.axes for t in program.collectives}
                for axes in sorted(used - set(names)):  # (every rank in the same order)
                    names[axes] = axes_group(self.device, program.mesh, axes).group_name
        self.spec = StepSpec(graph, strategy, program, self.rank, names, autocast,
                             self.device.type, local_collectives)
        self._steps: dict[tuple, object] = {}
        self.grads: dict[str, torch.Tensor] = {}
        # calibration.ops: a TaskClock whose enter/leave the graph-mode step calls around each
        # task (set before the first step: steps traced earlier keep running untimed)
        self.clock = None

    # -- one step ---------------------------------------------------------------------------
    def step(self, inputs: dict[str, torch.Tensor], update: bool = True,
             labels: bool = False) -> torch.Tensor:
        """One training step on the global batch `inputs` (user input name -> whole tensor, the
        same on every rank); returns the step's loss as a 0-d tensor (no host sync). With
        update=False the parameters stay and the gradients are left in `self.grads`. With labels
        (graph mode) each task runs under a profiler label named as in simulated traces."""
        xs = [inputs[n.source].to(self.device, non_blocking=True) for n in self.g.user_inputs]
        run = self.compiled(update, xs, labels)
        with torch.no_grad():
            out = run(*self.params.values(), *self.buffers, *xs, self.lr)
        if not update:
            self.grads = dict(zip(self.p.param_grads, out[1:]))
        return out[0]

    def compiled(self, update: bool, xs: list[torch.Tensor], labels: bool = False):
        """The step for these input shapes, traced (and compiled or captured) on first use."""
        key = (update, tuple(tuple(x.shape) for x in xs), labels and self.mode == "graph")
        run = self._steps.get(key)
        if run is None and self.mode == "untraced":
            run = self._steps[key] = untraced_step(self.spec, len(self.params), len(self.buffers),
                                                   update)
        if run is None:
            gm = trace_step(self.spec, list(self.params.values()), self.buffers, xs, self.lr,
                            update)
            log.debug("rank %d: traced the step, %d graph nodes", self.rank, len(gm.graph.nodes))
            if key[2]:
                gm = labelled(gm, self.p)
            elif self.clock is not None and self.mode == "graph":
                gm = with_hooks(gm, self.clock.enter, self.clock.leave)
            run = self._steps[key] = self._finish(gm, update)
        return run

    def _finish(self, gm: torch.fx.GraphModule, update: bool):
        if self.mode == "compile":
            return inductor_segments(gm).forward
        if self.mode == "cuda-graphs":
            return CudaGraphStep(gm, self, update)
        return gm.forward

    def stand_in_collectives(self) -> None:
        """Calibration (calibration.ops --collectives local): from the next step on, every
        collective is a local copy of its shapes and nothing is sent."""
        self.spec = replace(self.spec, group_names={}, local_collectives=True)
        self._steps.clear()

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (a tensor the step reads: nothing is retraced)."""
        self.lr.fill_(float(lr))

    def full(self, node: str, local: torch.Tensor) -> torch.Tensor:
        """Parameter `node`'s whole tensor from this rank's shard `local` (or its gradient's),
        gathered axis by axis, the innermost first, along the axes its storage placements
        split (Strategy.storage; for checks, outside the timed step)."""
        mesh = self.p.grid
        for axis, placement in reversed(list(zip(mesh.names, self.s.storage(node, self.p.world)))):
            if mesh.size(axis) > 1:
                group = None if len(mesh.names) == 1 else axes_group(self.device, mesh, (axis,))
                local = full_tensor(local, placement, mesh.size(axis), group)
        return local


_MESHES: dict = {}


def device_mesh(device: torch.device, mesh: Mesh):
    """The DeviceMesh of a plan's mesh over the default process group, with its axes' names,
    made once per default group (its groups are hidup.strategy.Mesh.groups)."""
    key = (id(dist.group.WORLD), device.type, mesh)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh(device.type, mesh.shape, mesh_dim_names=mesh.names)
    return _MESHES[key]


def axes_group(device: torch.device, mesh: Mesh, axes: tuple[str, ...]):
    """This rank's process group along the mesh's `axes`: the DeviceMesh's group of one axis,
    the world's for every axis, else one of the groups made (once, on every rank alike) for
    the mesh's groups along them."""
    if len(axes) == 1:
        return device_mesh(device, mesh).get_group(axes[0])
    if tuple(axes) == mesh.names:
        return dist.group.WORLD
    key = (id(dist.group.WORLD), device.type, mesh, tuple(axes))
    if key not in _MESHES:
        _MESHES[key], _ = dist.new_subgroups_by_enumeration(
            [list(g) for g in mesh.groups(axes)])
    return _MESHES[key]


# the executor's modes: the planned ones (a profile can give each one's host costs) and
# 'untraced', for checks of a step or two
RUN_MODES = (*MODES, "untraced")


def _check(program: Program, mode: str, device: torch.device) -> None:
    if mode not in RUN_MODES:
        raise ValueError(f"executor mode {mode!r}: choose one of {list(RUN_MODES)}")
    if mode == "cuda-graphs" and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA device, this run is on {device.type}; "
                         f"leave it out (or use --compile) on the CPU")


class CudaGraphStep:
    """The traced step captured as one CUDA graph (collectives included) and replayed: the
    inputs are copied into static buffers, the parameters are updated in place as always."""

    def __init__(self, gm: torch.fx.GraphModule, executor: Executor, update: bool):
        self.gm, self.ex, self.update = gm, executor, update
        self.graph = None

    def __call__(self, *args):
        if self.graph is None:
            self._capture(args)
        n = len(self.static)
        for buf, x in zip(self.static, args[-1 - n:-1]):
            buf.copy_(x, non_blocking=True)
        self.graph.replay()
        return [t.clone() for t in self.out]  # the next replay overwrites the static outputs

    def _capture(self, args) -> None:
        """Warm up on a side stream (lazy initialisations), capture, and undo the warm-up's
        updates so that the first replay is the first step."""
        ex = self.ex
        n_fixed = len(ex.params) + len(ex.buffers)
        self.static = [x.clone() for x in args[n_fixed:-1]]
        keep = [p.clone() for p in ex.params.values()]
        side = torch.cuda.Stream(ex.device)
        side.wait_stream(torch.cuda.current_stream(ex.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.gm(*args)
        torch.cuda.current_stream(ex.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.gm(*args[:n_fixed], *self.static, args[-1])
        with torch.no_grad():
            for p, saved in zip(ex.params.values(), keep):
                p.copy_(saved)


def labelled(gm: torch.fx.GraphModule, program: Program) -> torch.fx.GraphModule:
    """The step with each task's nodes under a profiler label ('fwd linear mb0', as the simulator
    names its events), for `hidup.train --trace`."""
    names = {t.id: task_label(t) for t in program.tasks}
    names[INPUT_TASK] = "shard inputs"

    def enter(task, standin):
        return torch.autograd.profiler.record_function(names.get(task, "step")).__enter__()

    def leave(handle):
        handle.__exit__(None, None, None)

    return with_hooks(gm, enter, leave)


def full_tensor(local: torch.Tensor, placement: Placement, world: int, group=None) -> torch.Tensor:
    """Reassemble a whole tensor from its shards (for checks, outside the timed step)."""
    if isinstance(placement, Shard) and world > 1:
        parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=placement.dim)
    if isinstance(placement, Partial) and world > 1:
        y = local.clone()
        dist.all_reduce(y, group=group)
        return y
    return local
