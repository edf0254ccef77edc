"""The Trainer's state (hidup.runtime.trainer): `state_dict()` / `load_state_dict()` for
torch.distributed.checkpoint, each parameter and optimizer state a DTensor in its placement (a
plain tensor with one rank), so that a checkpoint written under one plan and world size loads
under another (`save_checkpoint` / `load_checkpoint`, torch.distributed.checkpoint's failures
raised as the first rank's own error); `full_state_dict()` gathers whole tensors for the user's
own module."""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from hidup.runtime.execute import device_mesh
from hidup.runtime.layout import param_shard, whole_shape


class TrainerState:
    """The state half of hidup.runtime.trainer.Trainer, which it is mixed into: reads what the
    Trainer builds (executor, optimizer, lr_scheduler, steps, extra_state, strategy, program,
    world, rank, device, and the graph's names: _sources, _trainable, _tied, _buffers,
    _model_keys)."""

    def state_dict(self) -> dict:
        """The run's state for torch.distributed.checkpoint: parameters and optimizer states
        ("optim", keyed 'NAME::STATE') as DTensors in their placements (plain tensors with one
        rank), and as JSON the optimizer's settings, the schedule, the step count and
        `extra_state`."""
        self._require_built("state_dict")
        names = self._names_of_shards()
        model = {self._sources[n]: self._distributed(n, p) for n, p in
                 self.executor.params.items()}
        optim = {}
        for shard, state in self.optimizer.state.items():
            node = names[id(shard)]
            for key, value in state.items():
                if _elementwise(value, shard):
                    value = self._distributed(node, value)
                optim[f"{self._sources[node]}::{key}"] = value
        groups = [{k: v for k, v in g.items() if k != "params"} |
                  {"params": [self._sources[names[id(p)]] for p in g["params"]]}
                  for g in self.optimizer.param_groups]
        extra = {"param_groups": groups, "steps": self.steps,
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                 "user": self.extra_state}
        return {"model": model, "optim": optim, "extra": json.dumps(extra, default=_plain)}

    def load_state_dict(self, state: dict) -> None:
        """Load a state_dict() (this trainer's or another's, under any plan, or one that
        torch.distributed.checkpoint.load filled): each tensor is cut to this rank's piece in
        this plan's placement; the optimizer's state becomes the saved one."""
        self._require_built("load_state_dict")
        extra = json.loads(state["extra"])
        if len(extra["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError(f"the saved optimizer has {len(extra['param_groups'])} parameter "
                             f"groups, this one {len(self.optimizer.param_groups)}: make the "
                             f"optimizer as the run that saved it did")
        by_source = {self._sources[n]: (n, shard) for n, shard in self.executor.params.items()}
        with torch.no_grad():
            for source, (node, shard) in by_source.items():
                shard.copy_(self._local(node, state["model"][source]))
            saved: dict = {}
            for entry, value in state["optim"].items():
                source, key = entry.rsplit("::", 1)
                saved.setdefault(source, {})[key] = value
            names = self._names_of_shards()
            for shard in self._trainable:
                node = names[id(shard)]
                mine = saved.get(self._sources[node])
                if not mine:
                    self.optimizer.state.pop(shard, None)
                    continue
                self.optimizer.state[shard] = {
                    key: (self._local(node, value).clone() if _elementwise(value, shard)
                          else value.clone() if isinstance(value, torch.Tensor) else value)
                    for key, value in mine.items()}
        for group, kept in zip(self.optimizer.param_groups, extra["param_groups"]):
            for key, value in kept.items():
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

        with _plain_failures():
            dcp.save(self.state_dict(), checkpoint_id=str(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Load a checkpoint folder written by save_checkpoint under any plan or world size."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not (Path(path) / ".metadata").is_file():
            raise FileNotFoundError(f"no checkpoint in {path} (no .metadata file): give a folder "
                                    f"written by Trainer.save_checkpoint")
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        state = self.state_dict()
        state["optim"] = {}  # what the checkpoint holds, in this plan's placements
        shards = {self._sources[n]: (n, t) for n, t in self.executor.params.items()}
        for entry, meta in saved.items():
            if not entry.startswith("optim."):
                continue
            source, key = entry.removeprefix("optim.").rsplit("::", 1)
            node, shard = shards[source]
            if not isinstance(meta, TensorStorageMetadata):
                template = None  # a number: read as it was written
            elif tuple(meta.size) == self._full_shape(node, shard):
                template = self._distributed(node, torch.zeros_like(shard,
                                                                    dtype=meta.properties.dtype))
            else:
                template = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)
            state["optim"][f"{source}::{key}"] = template
        with _plain_failures():
            dcp.load(state, checkpoint_id=str(path))
        self.load_state_dict(state)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole parameters and buffers by the module's names, on the CPU, on every rank:
        `model.load_state_dict(trainer.full_state_dict())` loads them into the user's module."""
        self._require_built("full_state_dict")
        out = {}
        for node, shard in self.executor.params.items():
            whole = self.executor.full(node, shard)
            out[self._sources[node]] = whole.detach().cpu().clone()
        for alias, used in self._tied.items():  # one tensor in the module: the trained value
            out[alias] = out[used]
        for source, buf in zip(self._buffers, self.executor.buffers):
            if source in self._model_keys:
                out[source] = buf.detach().cpu().clone()
        return out

    # -- helpers ----------------------------------------------------------------------------
    def _require_built(self, what: str) -> None:
        if self.executor is None:
            raise RuntimeError(f"{what}(): with a fixed strategy the model is captured at the "
                               f"first step(); give parallelize(..., example_inputs=BATCH) to "
                               f"build at once, or run one step first")

    def _full_shape(self, node: str, local: torch.Tensor) -> tuple[int, ...]:
        return whole_shape(local.shape, self._placements(node), self.program.grid)

    def _distributed(self, node: str, local: torch.Tensor):
        """A rank's shard as a DTensor over the world in the parameter's placement."""
        if self.world == 1:
            return local
        from torch.distributed.tensor import DTensor

        shape = self._full_shape(node, local)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, device_mesh(self.device, self.program.grid),
                                  self._placements(node),
                                  run_check=False, shape=torch.Size(shape), stride=stride)

    def _placements(self, node: str) -> list:
        """The DTensor placements of a parameter (and its optimizer states) in this plan, one
        per mesh axis: its storage (Strategy.storage)."""
        return list(self.strategy.storage(node, self.world))

    def _names_of_shards(self) -> dict[int, str]:
        return {id(t): n for n, t in self.executor.params.items()}

    def _local(self, node: str, value) -> torch.Tensor:
        """This rank's piece, in this plan's placement, of a saved value: a DTensor in this
        placement (its local part), one in another (whole, then cut), or a whole tensor."""
        from torch.distributed.tensor import DTensor

        if isinstance(value, DTensor):
            if list(value.placements) == self._placements(node):
                return value.to_local()
            value = value.full_tensor()  # written under another plan
        return param_shard(value, self.strategy, node, self.rank, self.executor.per_machine)


@contextlib.contextmanager
def _plain_failures():
    """torch.distributed.checkpoint raises a CheckpointException, a BaseException that no
    `except Exception` catches, wrapping each rank's failure: raise the first rank's own error
    instead (a lost peer's RuntimeError, a full disk's OSError, ...)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = [f[0] if isinstance(f, tuple) else f for f in (exc.failures or {}).values()]
        first = next((f for f in failures if isinstance(f, Exception)), None)
        raise (first or RuntimeError(str(exc))) from None


def _elementwise(value, shard: torch.Tensor) -> bool:
    """Is an optimizer state one value per parameter element (sharded as the parameter)? A
    DTensor is one (state_dict makes them of such states only), of whatever global shape."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return True
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shard.shape


def _plain(value):
    """JSON for what optimizer settings and schedules hold besides numbers."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if callable(value):
        return None
    raise TypeError(f"cannot save {type(value).__name__} in a checkpoint's settings")
