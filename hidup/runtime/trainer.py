"""The Trainer: a plan run for real with the user's optimizer (`hidup.parallelize`).

Each rank holds its shards of the parameters (hidup.runtime.execute.Executor). A step runs the
rank's compiled step without its built-in update: forward, backward and the gradient reductions of
every micro-batch, returning the gradients in the parameters' own placements; the user's
`torch.optim` optimizer then updates the shards (an element-wise update such as SGD or AdamW on a
shard is the update of that part of the whole tensor, so the run equals single-device training).

Checkpoints go through torch.distributed.checkpoint: `state_dict()` holds each parameter and
optimizer state as a DTensor in its placement (a plain tensor with one rank), so a checkpoint
written under one plan and world size loads under another (`save_checkpoint` /
`load_checkpoint`); `full_state_dict()` gathers whole tensors for the user's own module."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from hidup.graph import ops
from hidup.graph.capture import capture
from hidup.graph.placement import Shard
from hidup.planning.planfile import PlanError, check
from hidup.planning.strategy import fixed_strategy
from hidup.program import lower
from hidup.runtime.execute import Executor, full_tensor
from hidup.runtime.step import shard_of

log = logging.getLogger(__name__)
FIXED = ("ddp", "megatron", "expert")


class Trainer:
    """One rank's part of a parallel training run; made by `hidup.parallelize`."""

    def __init__(self, model: torch.nn.Module, plan, optimizer: Callable, lr_scheduler=None,
                 compile: bool = False, device: torch.device | str | None = None,
                 micro_batches: int | None = None, autocast: torch.dtype | None = None,
                 cuda_graphs: bool = False):
        from hidup.api import Plan, example_inputs

        if compile and cuda_graphs:
            raise ValueError("compile and cuda_graphs: choose one of them")
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        self.device = torch.device(device) if device is not None else _default_device()
        if isinstance(plan, str):
            if plan not in FIXED:
                raise ValueError(f"plan {plan!r}: give a hidup.Plan or one of {list(FIXED)}")
        elif not isinstance(plan, Plan):
            raise TypeError(f"plan: give a hidup.Plan (hidup.plan(...) or hidup.Plan.load) or "
                            f"one of {list(FIXED)}, got {type(plan).__name__}")
        elif plan.gpus != self.world:
            raise ValueError(f"the plan is for {plan.gpus} ranks, this run has {self.world}; "
                             f"start {plan.gpus} ranks (torchrun --nproc-per-node "
                             f"{plan.gpus}) or make a plan for {self.world} with "
                             f"hidup.plan(..., gpus={self.world})")
        self._model_keys = set(model.state_dict())
        self._fixed, self._plan = (plan, None) if isinstance(plan, str) else (None, plan)
        self._micro_batches = micro_batches
        self._factories = (optimizer, lr_scheduler)
        self._mode = "cuda-graphs" if cuda_graphs else "compile" if compile else "graph"
        self._autocast = autocast
        self._model = model
        # JSON-able values of the caller's own (e.g. hidup.train's losses and random state),
        # saved in the state's "extra" and restored by load_state_dict
        self.extra_state: dict = {}
        self.executor: Executor | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        self.steps = 0
        if self._plan is not None:  # the plan knows the inputs: build now (a resume needs it)
            graph = self._plan.graph or capture(model, example_inputs(self._plan.inputs))
            self._build(graph)

    # -- building ---------------------------------------------------------------------------
    def _build(self, graph) -> None:
        """The executor, the optimizer and its schedule, for the captured graph."""
        ops.require_rules(graph)
        if self._plan is not None:
            if graph.fingerprint != self._plan.fingerprint:
                raise PlanError(f"the plan was made for another model (fingerprint "
                                f"{self._plan.fingerprint}, this model's is {graph.fingerprint}); "
                                f"plan this model with hidup.plan")
            check(graph, self._plan.strategy)
            strategy, k = self._plan.strategy, self._micro_batches or self._plan.micro_batches
            name, optimizer_name = self._plan.model, self._plan.optimizer
        else:
            strategy, k = fixed_strategy(self._fixed, graph, self.world), self._micro_batches or 1
            name, optimizer_name = type(self._model).__name__, "adamw"
        program = lower(graph, strategy, self.world, k, name, optimizer=optimizer_name)
        # on the run's device: NCCL broadcasts device tensors only
        params = {n: p.detach().to(self.device, copy=True)
                  for n, p in self._model.named_parameters()}
        buffers = {n: b.detach().to(self.device, copy=True)
                   for n, b in self._model.named_buffers()}
        if self.world > 1:  # every rank starts from rank 0's weights, as DDP does
            for t in [*params.values(), *buffers.values()]:
                dist.broadcast(t, 0)
        self.graph, self.strategy, self.program = graph, strategy, program
        self.executor = Executor(graph, strategy, program, params, 0.0, self.device,
                                 buffers=buffers, rank=self.rank, autocast=self._autocast,
                                 mode=self._mode)
        self._sources = {n.name: n.source for n in graph.params}
        self._inputs = [n.source for n in graph.user_inputs]
        self._buffers = [n.source for n in graph.nodes if n.kind == "buffer"]
        make_optimizer, make_schedule = self._factories
        self.optimizer = make_optimizer(list(self.executor.params.values()))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: give a function of the parameters that returns a "
                            f"torch.optim optimizer, e.g. lambda params: torch.optim.AdamW("
                            f"params, lr=3e-4); it returned {type(self.optimizer).__name__}")
        self.lr_scheduler = make_schedule(self.optimizer) if make_schedule else None
        self._model = None  # the weights now live in the shards

    # -- training ---------------------------------------------------------------------------
    def step(self, *inputs: torch.Tensor, labels: bool = False) -> torch.Tensor:
        """One training step on the global batch `inputs` (the same tensors on every rank, in
        the order of the model's forward; each rank takes its shard): forward, backward,
        gradient reductions, the optimizer's step and the schedule's. Returns the loss. With
        `labels` (no compile) each task runs under a torch.profiler label named as in simulated
        traces."""
        if self.executor is None:  # a fixed strategy: captured at the first batch's shapes
            self._build(capture(self._model, tuple(inputs)))
        if len(inputs) != len(self._inputs):
            raise ValueError(f"step() takes the model's {len(self._inputs)} inputs "
                             f"({', '.join(self._inputs)}), got {len(inputs)}")
        loss = self.executor.step(dict(zip(self._inputs, inputs)), update=False, labels=labels)
        for name, shard in self.executor.params.items():
            grad = self.executor.grads.get(name)
            shard.grad = None if grad is None else grad.reshape(shard.shape)
        self.optimizer.step()
        for shard in self.executor.params.values():
            shard.grad = None
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.steps += 1
        return loss

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The run's state for torch.distributed.checkpoint: parameters and optimizer states as
        DTensors in their placements (plain tensors with one rank), the optimizer's settings,
        the schedule and the step count. Optimizer states are made if no step has run yet, so
        that a checkpoint can be loaded into it."""
        self._require_built("state_dict")
        _init_optimizer_state(self.optimizer)
        index = {id(p): i for i, p in enumerate(self.executor.params.values())}
        names = list(self.executor.params)
        model = {self._sources[n]: self._distributed(n, p) for n, p in
                 self.executor.params.items()}
        optim = {}
        for shard, state in self.optimizer.state.items():
            node = names[index[id(shard)]]
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == shard.shape and \
                        value.dim() > 0:
                    value = self._distributed(node, value)
                optim[f"{self._sources[node]}.{key}"] = value
        groups = [{k: v for k, v in g.items() if k != "params"} |
                  {"params": [self._sources[names[index[id(p)]]] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        extra = {"param_groups": groups, "steps": self.steps,
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                 "user": self.extra_state}
        return {"model": model, "optim": optim, "extra": json.dumps(extra, default=_plain)}

    def load_state_dict(self, state: dict) -> None:
        """Load a state_dict() (after torch.distributed.checkpoint.load filled it, or this
        trainer's own): each tensor is cut to this rank's placement, whatever plan wrote it."""
        self._require_built("load_state_dict")
        _init_optimizer_state(self.optimizer)
        names = list(self.executor.params)
        index = {id(p): i for i, p in enumerate(self.executor.params.values())}
        with torch.no_grad():
            for node, shard in self.executor.params.items():
                shard.copy_(self._local(node, state["model"][self._sources[node]]))
            for shard, mine in self.optimizer.state.items():
                node = names[index[id(shard)]]
                for key, value in mine.items():
                    saved = state["optim"][f"{self._sources[node]}.{key}"]
                    if isinstance(value, torch.Tensor):
                        value.copy_(self._local(node, saved) if value.dim() > 0 and
                                    value.shape == shard.shape else _as_tensor(saved))
        extra = json.loads(state["extra"])
        for group, saved in zip(self.optimizer.param_groups, extra["param_groups"]):
            for key, value in saved.items():
                if key == "params":
                    continue
                if isinstance(group.get(key), torch.Tensor):
                    group[key].fill_(value)
                else:
                    group[key] = tuple(value) if isinstance(group.get(key), tuple) else value
        if self.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.steps = extra["steps"]
        self.extra_state = extra.get("user") or {}

    def save_checkpoint(self, path: str | Path) -> None:
        """Write the state to folder `path` with torch.distributed.checkpoint (every rank)."""
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state_dict(), checkpoint_id=str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Load a checkpoint folder written by save_checkpoint under any plan or world size."""
        import torch.distributed.checkpoint as dcp

        if not (Path(path) / ".metadata").is_file():
            raise FileNotFoundError(f"no checkpoint in {path} (no .metadata file): give a folder "
                                    f"written by Trainer.save_checkpoint")
        state = self.state_dict()
        dcp.load(state, checkpoint_id=str(path))
        self.load_state_dict(state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers by the module's names, on the CPU, on every rank:
        `model.load_state_dict(trainer.full_state_dict())` loads them into the user's module."""
        self._require_built("full_state_dict")
        out = {}
        for node, shard in self.executor.params.items():
            whole = full_tensor(shard, self.strategy.home(node), self.world)
            out[self._sources[node]] = whole.detach().cpu().clone()
        for source, buf in zip(self._buffers, self.executor.buffers):
            if source in self._model_keys:
                out[source] = buf.detach().cpu().clone()
        return out

    # -- helpers ----------------------------------------------------------------------------
    def _require_built(self, what: str) -> None:
        if self.executor is None:
            raise RuntimeError(f"{what}(): with a fixed strategy the model is captured at the "
                               f"first step(); run one step first, or parallelize with a "
                               f"hidup.Plan")

    def _full_shape(self, node: str, local: torch.Tensor) -> tuple[int, ...]:
        shape = list(local.shape)
        home = self.strategy.home(node)
        if isinstance(home, Shard) and self.world > 1:
            shape[home.dim] *= self.world
        return tuple(shape)

    def _distributed(self, node: str, local: torch.Tensor):
        """A rank's shard as a DTensor over the world in the parameter's placement."""
        if self.world == 1:
            return local
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor import Shard as DShard

        home = self.strategy.home(node)
        placement = DShard(home.dim) if isinstance(home, Shard) else Replicate()
        shape = self._full_shape(node, local)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, _mesh(self.device, self.world), [placement],
                                  run_check=False, shape=torch.Size(shape), stride=stride)

    def _local(self, node: str, value) -> torch.Tensor:
        """This rank's piece, in this plan's placement, of a saved value (a DTensor whose local
        part is already it, or a whole tensor)."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            return value.to_local()
        return shard_of(value, self.strategy.home(node), None, 1, None, self.rank, self.world)


def parallelize(model: torch.nn.Module, plan, *, optimizer: Callable,
                lr_scheduler: Callable | None = None, compile: bool = False,
                device: torch.device | str | None = None,
                micro_batches: int | None = None, autocast: torch.dtype | None = None,
                cuda_graphs: bool = False) -> Trainer:
    """Run `plan` (a hidup.Plan, or "ddp" / "megatron" / "expert") for `model` on this rank (under
    torchrun with the process group initialized, or alone): returns the Trainer.

    optimizer: a function of the parameters that returns a torch.optim optimizer (it gets this
    rank's shards), e.g. `lambda params: torch.optim.AdamW(params, lr=3e-4)`; lr_scheduler
    likewise a function of the optimizer, e.g. `lambda opt: CosineAnnealingLR(opt, 1000)`.
    compile: run the step through torch.compile (Inductor); cuda_graphs (CUDA only): capture the
    step (forward, backward and collectives; not the optimizer's update) once as a CUDA graph and
    replay it. micro_batches overrides the plan's (1: plain SPMD, 2 or more: Duplex). autocast:
    a dtype such as torch.bfloat16 runs each op under torch.autocast (weights, gradients and
    communication stay in their own dtype)."""
    return Trainer(model, plan, optimizer, lr_scheduler, compile, device, micro_batches,
                   autocast, cuda_graphs)


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


_MESHES: dict = {}


def _mesh(device: torch.device, world: int):
    key = (device.type, world)
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[key] = init_device_mesh(device.type, (world,))
    return _MESHES[key]


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the optimizer's state before its first step, so that a checkpoint can be loaded into
    it: a step with zero gradients at learning rate 0 (the parameters stay as they are; SGD's
    momentum, Adam's moments and Adagrad's sums stay zero), then its step counts set back to 0,
    so that the first real step is as a fresh optimizer's."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if all(p in optimizer.state and optimizer.state[p] for p in params):
        return
    saved = []
    for group in optimizer.param_groups:
        saved.append(group["lr"])
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = group["lr"].clone().fill_(0.0)
        else:
            group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None
        for key, value in optimizer.state[p].items():  # no step has been taken
            if key == "step" and isinstance(value, torch.Tensor):
                value.zero_()
            elif key == "step":
                optimizer.state[p][key] = 0
    for group, lr in zip(optimizer.param_groups, saved):
        group["lr"] = lr


def _plain(value):
    """JSON for what optimizer settings and schedules hold besides numbers."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if callable(value):
        return None
    raise TypeError(f"cannot save {type(value).__name__} in a checkpoint's settings")


def _as_tensor(value) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)
