"""The Trainer: a plan run for real with the user's optimizer (`hidup.parallelize`).

Each rank holds its shards of the parameters (hidup.runtime.execute.Executor). A step runs the
rank's compiled step without its built-in update: forward, backward and the gradient reductions of
every micro-batch, returning the gradients in the parameters' own placements; the user's
`torch.optim` optimizer then updates the shards (an element-wise update such as SGD or AdamW on a
shard is the update of that part of the whole tensor, so the run equals single-device training).
How it runs (compile, CUDA graphs, device, micro-batches, autocast) is one `RunOptions`.

Checkpoints (`state_dict()`, `save_checkpoint`, `load_checkpoint`, `full_state_dict()`) are the
Trainer's state half, hidup.runtime.trainer_state."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

from hidup.graph.capture import TensorMeta, capture
from hidup.graph.dtypes import run_dtypes
from hidup.graph.placement import Shard
from hidup.planning.planfile import Plan, PlanError, check
from hidup.planning.planfile import example_inputs as zeros_like_inputs
from hidup.program import lower
from hidup.runtime.execute import Executor
from hidup.runtime.materialize import is_meta, local_weights
from hidup.runtime.trainer_state import TrainerState
from hidup.strategy import FIXED as FIXED_STRATEGIES
from hidup.strategy import fixed_strategy

log = logging.getLogger(__name__)
FIXED = tuple(FIXED_STRATEGIES)  # a fixed strategy by name works wherever a Plan does


@dataclass(frozen=True)
class RunOptions:
    """How a Trainer runs its step (hidup.parallelize's keywords of the same names).

    compile: through torch.compile (Inductor); cuda_graphs (CUDA only): the step captured once as
    a CUDA graph and replayed (at most one of the two); device: None for the process group's
    (cuda:LOCAL_RANK under NCCL, else the CPU); micro_batches: None for the plan's (1 with a
    fixed strategy); autocast: a dtype such as torch.bfloat16 for each op under torch.autocast."""

    compile: bool = False
    cuda_graphs: bool = False
    device: torch.device | str | None = None
    micro_batches: int | None = None
    autocast: torch.dtype | None = None

    def __post_init__(self):
        if self.compile and self.cuda_graphs:
            raise ValueError("compile and cuda_graphs: choose one of them")

    @property
    def mode(self) -> str:
        """The Executor's mode."""
        return "cuda-graphs" if self.cuda_graphs else "compile" if self.compile else "graph"


class Trainer(TrainerState):
    """One rank's part of a parallel training run; made by `hidup.parallelize`."""

    def __init__(self, model: torch.nn.Module, plan, optimizer: Callable, lr_scheduler=None,
                 options: RunOptions = RunOptions(), *, example_inputs: tuple | None = None,
                 state_dict: dict | None = None):
        if not isinstance(options, RunOptions):
            raise TypeError(f"options: give a RunOptions (hidup.parallelize makes one of its "
                            f"keywords), got {type(options).__name__}")
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if self.world > 1 else 0
        device = options.device
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
        self.options = options
        self._factories = (optimizer, lr_scheduler)
        self._model = model
        self._state_dict = state_dict
        # JSON-able values of the caller's own (e.g. hidup.train's losses and random state),
        # saved in the state's "extra" and restored by load_state_dict
        self.extra_state: dict = {}
        self.executor: Executor | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler = None
        self.steps = 0
        if self._plan is not None:  # the plan knows the inputs: build now (a resume needs it)
            graph = self._plan.graph or capture(model, zeros_like_inputs(self._plan.inputs))
            self._build(graph)
        elif example_inputs is not None:
            self._build(capture(model, tuple(example_inputs)))

    # -- building ---------------------------------------------------------------------------
    def _build(self, graph) -> None:
        """The executor, the optimizer and its schedule, for the captured graph."""
        if self._plan is not None:
            if graph.fingerprint != self._plan.fingerprint:
                raise PlanError(f"the plan was made for another model (fingerprint "
                                f"{self._plan.fingerprint}, this model's is {graph.fingerprint}); "
                                f"plan this model with hidup.plan")
            check(graph, self._plan.strategy)
            strategy = self._plan.strategy
            k = self.options.micro_batches or self._plan.micro_batches
            name, optimizer_name = self._plan.model, self._plan.optimizer
        else:
            strategy = fixed_strategy(self._fixed, graph, self.world)
            k = self.options.micro_batches or 1
            name, optimizer_name = type(self._model).__name__, None
        if optimizer_name is None:  # priced as what the factory makes (tried on a scalar)
            optimizer_name = kind_of(self._factories[0]([torch.zeros(1)])) or "adamw"
        # the Program of the run's dtypes: under bf16 autocast, parameters gathered in bf16
        if self.options.autocast is None and self._plan is not None and \
                self._plan.precision == "bf16":  # run as planned
            self.options = replace(self.options, autocast=torch.bfloat16)
        precision = "bf16" if self.options.autocast == torch.bfloat16 else "fp32"
        program = lower(run_dtypes(graph, precision, self.device.type), strategy, self.world, k,
                        name, optimizer=optimizer_name)
        # on the run's device (NCCL broadcasts device tensors only), by the graph's names: tied
        # weights (one tensor under two names) are one placeholder
        named = dict(self._model.named_parameters(remove_duplicate=False))
        local = self._state_dict is not None or is_meta(self._model)
        if local:  # this rank's shards only, never the whole model
            params, buffers = local_weights(self._model, graph, strategy, self.rank,
                                            program.row, self.device, self._state_dict)
        else:
            params = {n.source: named[n.source].detach().to(self.device, copy=True)
                      for n in graph.params}
            buffers = {n: b.detach().to(self.device, copy=True)
                       for n, b in self._model.named_buffers()}
            if self.world > 1:  # every rank starts from rank 0's weights, as DDP does
                for t in [*params.values(), *buffers.values()]:
                    dist.broadcast(t, 0)
        self._state_dict = None
        self.graph, self.strategy, self.program = graph, strategy, program
        self.executor = Executor(graph, strategy, program, params, 0.0, self.device,
                                 buffers=buffers, rank=self.rank, autocast=self.options.autocast,
                                 mode=self.options.mode, local=local)
        self._sources = {n.name: n.source for n in graph.params}
        self._tied = _tied_aliases(graph, named)
        self._inputs = [n.source for n in graph.user_inputs]
        self._buffers = [n.source for n in graph.nodes if n.kind == "buffer"]
        # frozen parameters are not updated, as in eager
        self._trainable = [shard for n, shard in zip(graph.params, self.executor.params.values())
                           if named[n.source].requires_grad]
        make_optimizer, make_schedule = self._factories
        self.optimizer = make_optimizer(list(self._trainable))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer: give a function of the parameters that returns a "
                            f"torch.optim optimizer, e.g. lambda params: torch.optim.AdamW("
                            f"params, lr=3e-4); it returned {type(self.optimizer).__name__}")
        _check_optimizer(self.optimizer, strategy, graph, program.optimizer)
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
        self._check_inputs(inputs)
        loss = self.executor.step(dict(zip(self._inputs, inputs)), update=False, labels=labels)
        trainable = {id(t) for t in self._trainable}
        for name, shard in self.executor.params.items():
            grad = self.executor.grads.get(name)
            if grad is not None and id(shard) in trainable:
                shard.grad = grad.reshape(shard.shape)
        self.optimizer.step()
        for shard in self._trainable:  # freed once used, as zero_grad(set_to_none=True)
            shard.grad = None
        self.executor.grads = {}
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.steps += 1
        return loss

    def _check_inputs(self, inputs) -> None:
        """The batch has the shapes and dtypes the step was traced for (one line if not)."""
        want = [n.out for n in self.graph.user_inputs]
        got = [TensorMeta(tuple(x.shape), str(x.dtype).removeprefix("torch.")) for x in inputs]
        if got != want:
            planned = ", ".join(f"{n.source} {n.out}" for n in self.graph.user_inputs)
            raise ValueError(f"step() takes the global batch it was planned for: {planned}; got "
                             f"{', '.join(map(str, got))}; plan again for another batch shape "
                             f"(a last, smaller batch: drop it or pad it)")


def parallelize(model: torch.nn.Module, plan, *, optimizer: Callable,
                lr_scheduler: Callable | None = None, compile: bool = False,
                device: torch.device | str | None = None,
                micro_batches: int | None = None, autocast: torch.dtype | None = None,
                cuda_graphs: bool = False, example_inputs: tuple | None = None,
                state_dict: dict | None = None) -> Trainer:
    """Run `plan` (a hidup.Plan, or a fixed strategy: "ddp", "fsdp", "megatron", "megatron-sp",
    "expert") for `model` on this rank (under torchrun with the process group initialized, or
    alone): returns the Trainer.

    optimizer: a function of the parameters that returns a torch.optim optimizer (it gets this
    rank's shards), e.g. `lambda params: torch.optim.AdamW(params, lr=3e-4)`; lr_scheduler
    likewise a function of the optimizer, e.g. `lambda opt: CosineAnnealingLR(opt, 1000)`.
    compile: run the step through torch.compile (Inductor); cuda_graphs (CUDA only): capture the
    step (forward, backward and collectives; not the optimizer's update) once as a CUDA graph and
    replay it. micro_batches overrides the plan's (1: plain SPMD, 2 or more: Duplex). autocast:
    a dtype such as torch.bfloat16 runs each op under torch.autocast, its output kept in the
    dtype autocast gives it, as in eager PyTorch (weights and their gradients stay float32).
    example_inputs (a global batch) lets a fixed strategy build at once instead of at the first
    step (a checkpoint can then be loaded before any step). Parameters with requires_grad False are not updated.

    A model built under `torch.device("meta")` (no storage) is planned and run without its
    whole weights on any rank: each rank makes its own shards, module by module, with the
    module's reset_parameters() or the enclosing model's _init_weights(module) (all ranks draw
    rank 0's random numbers); or, with state_dict (whole tensors by the module's names, e.g.
    read from a file), each rank cuts its shards out of it."""
    options = RunOptions(compile=compile, cuda_graphs=cuda_graphs, device=device,
                         micro_batches=micro_batches, autocast=autocast)
    return Trainer(model, plan, optimizer, lr_scheduler, options, example_inputs=example_inputs,
                   state_dict=state_dict)


def _default_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}")
    return torch.device("cpu")


ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "ASGD", "NAdam", "RAdam",
               "RMSprop", "Rprop")  # torch.optim classes whose update is element by element
NOT_ELEMENTWISE = ("Adafactor", "LBFGS", "SparseAdam", "Muon")


def kind_of(optimizer: torch.optim.Optimizer) -> str | None:
    """The name in hidup.program.OPTIMIZERS that prices this optimizer (sgd, sgd-momentum, adam,
    adamw), or None for one it does not list."""
    name = type(optimizer).__name__
    if name == "SGD":
        return "sgd-momentum" if any(g.get("momentum") for g in optimizer.param_groups) else "sgd"
    return {"Adam": "adam", "AdamW": "adamw"}.get(name)


def _check_optimizer(optimizer, strategy, graph, planned: str) -> None:
    """Refuse an optimizer whose update is not element by element when a parameter is split (its
    update on a shard would not be that part of the whole update); note one the plan did not
    price."""
    name = type(optimizer).__name__
    split = [n.source for n in graph.params if isinstance(strategy.home(n.name), Shard)]
    if name in NOT_ELEMENTWISE and split:
        raise ValueError(f"optimizer {name} does not update element by element, so its update of "
                         f"a shard is not the single-device update ({split[0]} is split by this "
                         f"plan); use an element-wise optimizer (AdamW, SGD, ...) or a plan that "
                         f"splits no parameter (\"ddp\")")
    if name not in ELEMENTWISE + NOT_ELEMENTWISE and split:
        log.warning("optimizer %s is not one HiDup knows: training equals single-device training "
                    "only if its update is element by element", name)
    kind = kind_of(optimizer)
    if kind and kind != planned:
        log.warning("the plan was priced for optimizer %s, this one is %s: its predicted memory "
                    "and update time assumed %s", planned, name, planned)


def _tied_aliases(graph, named: dict[str, torch.nn.Parameter]) -> dict[str, str]:
    """Tied weights (one tensor under several names): torch.export gives each name a placeholder
    but routes every use through one. {unused name: the name that is used}."""
    used = {n.source for n in graph.params if graph.consumers(n.name)}
    names_of: dict[int, list[str]] = {}
    for name, p in named.items():
        names_of.setdefault(id(p), []).append(name)
    aliases = {}
    for names in names_of.values():
        users = [n for n in names if n in used]
        aliases.update({n: users[0] for n in names if users and n not in used})
    return aliases
