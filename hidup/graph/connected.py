"""Items split into the groups that share a key (union-find), for passes that group ops or
tasks by the values they share."""
from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def connected(items: Sequence[T], keys: Callable[[T], Iterable[Hashable]]) -> list[list[T]]:
    """`items` split into the groups whose members share a key (through any chain of them),
    each group in the items' order, the groups in the order of their first member."""
    parent = list(range(len(items)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    seen: dict[Hashable, int] = {}
    for i, item in enumerate(items):
        for key in keys(item):
            if key in seen:
                parent[root(i)] = root(seen[key])
            else:
                seen[key] = i
    groups: dict[int, list[T]] = {}
    for i, item in enumerate(items):
        groups.setdefault(root(i), []).append(item)
    return list(groups.values())
