"""The model `python -m hidup.train --model` names, as a hidup.models.ModelSpec: a zoo model
NAME:SIZE, or the user's own package.module:factory (imported from here; factory() returns
(module, inputs)), each failure one line with its fix."""
from __future__ import annotations

import importlib

import torch

from hidup.models import ModelSpec, get_model, names
from hidup.runtime.data import DataError, Vocabulary
from hidup.train_options import USER_BATCH, TrainOptions


def user_model(arg: str) -> ModelSpec | None:
    """`--model package.module:factory`: the user's model as a ModelSpec (None where `arg` names
    a zoo model); raises ValueError, in one line with the fix, where it cannot be had."""
    module_name, colon, attr = arg.partition(":")
    zoo = {n.partition(":")[0] for n in names()}
    if module_name in zoo:
        return None
    if not colon or not attr or not module_name:
        if "." not in module_name:
            return None  # get_model says which zoo names there are
        raise ValueError(f"--model {arg}: give package.module:factory (a function returning "
                         f"(module, inputs)) or a zoo model NAME:SIZE")
    fix = (f"give a zoo model NAME:SIZE (e.g. {names()[0]}) or package.module:factory "
           f"importable from here (run from its folder or set PYTHONPATH)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if "." not in module_name and exc.name == module_name:
            return None  # a misspelt zoo name: get_model names the zoo
        raise ValueError(f"--model {arg}: cannot import {module_name} ({exc}); {fix}") from None
    except Exception as exc:  # the user's module failed while importing
        raise ValueError(f"--model {arg}: importing {module_name} failed ({type(exc).__name__}: "
                         f"{exc}); fix that module or {fix}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        what = "has no attribute" if factory is None else "has a non-callable"
        raise ValueError(f"--model {arg}: module {module_name} {what} {attr!r}; give a function "
                         f"of no arguments that returns (module, inputs), e.g. "
                         f"{module_name}:make_model")
    shape = ("it must return (module, inputs): an nn.Module whose module(*batch) returns the "
             "loss, and inputs(batch_size, generator) returning the global batch as a tuple of "
             "tensors")

    def build() -> tuple[torch.nn.Module, object]:
        try:
            made = factory()
        except Exception as exc:
            raise ValueError(f"--model {arg}: {attr}() raised {type(exc).__name__}: {exc}; "
                             f"{shape}") from None
        if not (isinstance(made, (tuple, list)) and len(made) == 2 and
                isinstance(made[0], torch.nn.Module) and callable(made[1])):
            got = type(made).__name__ if not isinstance(made, (tuple, list)) else \
                f"({', '.join(type(m).__name__ for m in made)})"
            raise ValueError(f"--model {arg}: {attr}() returned {got}; {shape}")
        return made[0], made[1]

    made: dict = {}

    def inputs(batch: int, gen: torch.Generator) -> tuple:
        if "inputs" not in made:
            made["inputs"] = build()[1]
        try:
            out = made["inputs"](batch, gen)
        except Exception as exc:
            raise ValueError(f"--model {arg}: inputs({batch}, generator) raised "
                             f"{type(exc).__name__}: {exc}; {shape}") from None
        if isinstance(out, torch.Tensor):
            out = (out,)
        if not (isinstance(out, (tuple, list)) and out and
                all(isinstance(t, torch.Tensor) for t in out)):
            raise ValueError(f"--model {arg}: inputs({batch}, generator) returned "
                             f"{type(out).__name__}; {shape}")
        return tuple(out)

    def module() -> torch.nn.Module:
        model, made["inputs"] = build()
        return model

    return ModelSpec(arg, module, inputs, USER_BATCH, "user")


def model_spec(args: TrainOptions, world: int, vocab: Vocabulary | None) -> ModelSpec:
    """The ModelSpec of --model for `world` ranks (a zoo text model sized to `vocab`, the
    --data vocabulary); raises ValueError (DataError) naming what is wrong."""
    spec = user_model(args.model)
    if spec is None:
        try:
            return get_model(args.model, gpus=world, vocab=len(vocab) if vocab else None)
        except ValueError as exc:
            if not str(exc).startswith("unknown model"):
                raise
            raise ValueError(f"{exc}; or give your own model as package.module:factory") from None
    if vocab is not None:
        raise DataError(f"--data is text for the zoo's text models; {args.model} makes its own "
                        f"batches (its inputs function)")
    return spec
