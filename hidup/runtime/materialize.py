"""Weights for a rank without the whole model: a model built under `torch.device("meta")` (or
any model, given a state dict) becomes this rank's parameter shards only.

From a state dict, each rank cuts its shards out of the tensors it is given. Without one, the
modules are made real one at a time (`to_empty`), initialised as the model's own code does it
(the module's `reset_parameters()`, then the `_init_weights(module)` of the nearest enclosing
module that has one, as `transformers`' models do after construction), cut to this rank's
shards and put back on the meta device: at most one module's weights are whole at a time.
Every rank starts from rank 0's random state, so that all of them draw the same weights.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hidup.runtime.layout import param_shard


def is_meta(model: torch.nn.Module) -> bool:
    """Are some of the model's parameters or buffers on the meta device (no storage)?"""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def local_weights(model: torch.nn.Module, graph, strategy, rank: int, per_machine: int,
                  device: torch.device, state_dict: dict | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """({parameter name: this rank's shard}, {buffer name: whole buffer}) for the graph's
    parameters in the strategy's placements, on `device`, without the whole model at once."""
    wanted = {n.source: n.name for n in graph.params}  # module name -> graph node

    def cut(source: str, full: torch.Tensor) -> torch.Tensor:
        return param_shard(full.detach().to(device), strategy, wanted[source], rank,
                           per_machine).clone()

    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if state_dict is not None:
        missing = sorted(set(wanted) - set(state_dict))
        if missing:
            raise ValueError(f"state_dict: no tensor for the parameters {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}; give the model's whole "
                             f"state dict (model.state_dict() of a model with these names)")
        params = {s: cut(s, state_dict[s]) for s in wanted}
        buffers = {n: state_dict[n].detach().to(device).clone()
                   for n, _ in model.named_buffers() if n in state_dict}
    if len(params) < len(wanted) or len(buffers) < len(dict(model.named_buffers())):
        _from_modules(model, wanted, cut, params, buffers, device)
    return params, buffers


def _from_modules(model, wanted, cut, params, buffers, device) -> None:
    """Fill `params` (shards) and `buffers` (whole) for what they lack, a module at a time."""
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank draws rank 0's weights
        state = torch.get_rng_state()
        if dist.get_backend() == "gloo":
            dist.broadcast(state, 0)
        else:  # NCCL broadcasts device tensors only
            on_device = state.to(device)
            dist.broadcast(on_device, 0)
            state = on_device.cpu()
        torch.set_rng_state(state)
    owners = _init_owners(model)
    for prefix, module in model.named_modules(remove_duplicate=False):
        def own(kind):  # this module's own tensors by full name (new ones after to_empty)
            return {f"{prefix}.{n}" if prefix else n: t
                    for n, t in getattr(module, kind)(recurse=False)}

        new_params = [n for n in own("named_parameters") if n in wanted and n not in params]
        new_buffers = [n for n in own("named_buffers") if n not in buffers]
        if not new_params and not new_buffers:
            continue
        on_meta = any(t.is_meta for t in (*module.parameters(recurse=False),
                                          *module.buffers(recurse=False)))
        if on_meta:
            module.to_empty(device="cpu", recurse=False)
            _initialise(module, prefix, owners)
        tensors = {**own("named_parameters"), **own("named_buffers")}
        params.update({n: cut(n, tensors[n]) for n in new_params})
        buffers.update({n: tensors[n].detach().to(device).clone() for n in new_buffers})
        if on_meta:  # back to no storage: only this rank's shards stay
            module.to_empty(device="meta", recurse=False)


def _init_owners(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module name -> the nearest enclosing module (itself included) with `_init_weights`."""
    owners: dict[str, torch.nn.Module] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        parent = owners.get(prefix.rpartition(".")[0]) if prefix else None
        owners[prefix] = module if callable(getattr(module, "_init_weights", None)) else parent
    return owners


def _initialise(module: torch.nn.Module, prefix: str, owners) -> None:
    """As an eager build does: the module's reset_parameters() (its constructor's), then the
    enclosing model's _init_weights(module) (transformers' post_init), where they exist."""
    reset, owner = getattr(module, "reset_parameters", None), owners.get(prefix)
    with torch.no_grad():
        if callable(reset):
            reset()
        if owner is not None:
            owner._init_weights(module)
        if not callable(reset) and owner is None:
            raise ValueError(
                f"module {prefix or 'the model'} ({type(module).__name__}) is on the meta device "
                f"and has no reset_parameters() and no enclosing _init_weights(module) to "
                f"initialise it; give parallelize(..., state_dict=...) with its weights")
