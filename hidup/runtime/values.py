"""The values of one rank's traced step by key (hidup.runtime.step), and which memory more than
one of them shares: a gradient is accumulated in place only into memory no other value holds."""
from __future__ import annotations

import torch


class Values(dict):
    """The step's values by key, and which memory (storage) more than one of them uses."""

    def __init__(self):
        super().__init__()
        self.storages: set[int] = set()
        self.shared: set[int] = set()

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        super().__setitem__(key, value)
        self.keep(value)

    def keep(self, *tensors: torch.Tensor) -> None:
        """Note the memory of tensors the step holds on to (values, or kept for a backward)."""
        for t in tensors:
            storage = _storage(t)
            if storage in self.storages:
                self.shared.add(storage)
            self.storages.add(storage)

    def alone(self, key: str) -> bool:
        """Is the value of `key` the only holder of its memory (so it may be updated in place)?"""
        return _storage(self[key]) not in self.shared


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata
