"""The model zoo, selected by name with a size preset: 'NAME' or 'NAME:SIZE' (e.g. 'mlp:tiny')."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hidup.models import basic


@dataclass(frozen=True)
class ModelSpec:
    name: str  # 'mlp:tiny'
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, torch.Generator], tuple]  # global batch size, generator -> inputs
    batch: int  # default global batch size


_ZOO = {"mlp": basic.MLP_SIZES, "transformer": basic.TRANSFORMER_SIZES}


def names() -> list[str]:
    return [f"{n}:{s}" for n, sizes in _ZOO.items() for s in sizes]


def get_model(spec: str) -> ModelSpec:
    name, _, size = spec.partition(":")
    if name not in _ZOO:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(_ZOO)} (with a size, "
                         f"e.g. {names()[0]})")
    size = size or "tiny"
    if size not in _ZOO[name]:
        raise ValueError(f"model {name} has no size {size!r}; choose one of {sorted(_ZOO[name])}")
    return basic.spec(name, size, ModelSpec)
