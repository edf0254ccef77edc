"""The search programme's labels (hidup.planning.programme) and which of them it keeps. Only labels
that no other label beats on all four (time, debt, memory, plain) are kept: per state `labels` - 1
best either way, as many as a plain programme would keep, the leanest and the cheapest with k
(_trim), and the `beam` best states (some best either way, some cheapest with k, some with one;
and the one whose plan uses least memory, so that a memory limit further on can still be met)."""
from __future__ import annotations

from operator import attrgetter
from typing import NamedTuple

from hidup.graph.placement import ShardingOption

# With k > 1, the share of the beam kept for the states best either way, then for the cheapest
# with k micro-batches; the rest for the cheapest with one. Measured on 7 models: with (0.4, 0.3)
# the programme's best plan with one micro-batch is never worse than a plain programme's, nor its
# best with k than a Duplex-priced one's (with 2/3 best, 1/3 with k: 0.36% worse on gpt:paper).
_BEAM_SHARES = (0.4, 0.3)


class _Label(NamedTuple):  # a NamedTuple: the search makes hundreds of thousands of them
    time: float
    debt: float
    memory: float
    plain: float  # the same plan's time with one micro-batch (the k = 1 model)
    node: str = ""
    option: ShardingOption | None = None
    back: _Label | None = None

    @property
    def cost(self) -> float:
        """With k micro-batches."""
        return self.time + self.debt

    @property
    def best(self) -> float:
        """The plan runs with k micro-batches or with one, whichever is faster."""
        cost = self.time + self.debt
        return cost if cost < self.plain else self.plain


_BEST, _COST, _PLAIN, _MEMORY = (attrgetter(field) for field in ("best", "cost", "plain",
                                                                 "memory"))


def _frontier(labels: list[_Label]) -> list[_Label]:
    """The labels that no other beats on all four fields (time, debt, memory, plain), the
    first of equal ones. In this order, a label can only be beaten by one before it."""
    labels = sorted(labels, key=_VALUES)
    kept: list[_Label] = []
    for label in labels:
        d, m, p = label.debt, label.memory, label.plain
        for o in kept:  # o.time <= label.time
            if o.debt <= d and o.memory <= m and o.plain <= p:
                break
        else:
            kept.append(label)
    return kept


_VALUES = attrgetter("time", "debt", "memory", "plain")


class Beam:
    """The programme's pruning: which states and labels it keeps at a cut (a mixin of
    hidup.planning.programme.Search, whose `beam`, `per_state` and `k` it reads)."""

    def prune(self, states: dict) -> dict:
        """The `beam` best states (with k > 1: some best either way, some cheapest with k
        micro-batches, some with one; _BEAM_SHARES) and the one whose plan uses least memory;
        in each, the labels that no other label beats on all four fields (time, debt, memory,
        plain), and of those the ones _trim() keeps."""
        if len(states) > self.beam:
            keys, kept = list(states), {}
            least = {"cost": {key: min([lab.time + lab.debt for lab in labels])
                              for key, labels in states.items()},
                     "plain": {key: min(map(_PLAIN, labels)) for key, labels in states.items()},
                     "memory": {key: min(map(_MEMORY, labels))
                                for key, labels in states.items()}}
            least["best"] = {key: min(cost, least["plain"][key])  # the least of min(cost, plain)
                             for key, cost in least["cost"].items()}
            for field, upto in self._quotas():
                for key in sorted(keys, key=least[field].__getitem__):
                    if len(kept) >= upto:
                        break
                    kept.setdefault(key)
            states = {key: states[key] for key in kept}
        for key, labels in states.items():
            labels = _frontier(labels)
            states[key] = self._trim(labels) if len(labels) > self.per_state else labels
        return states

    def _trim(self, labels: list[_Label]) -> list[_Label]:
        """A state's labels: the `per_state` - 1 best, and with k > 1 the `per_state` - 1 that a
        plain programme and a Duplex-priced one would keep (cheapest with one micro-batch, and
        with k, among the labels that their own criteria do not dominate), and the leanest."""
        n = self.per_state - 1
        kept = sorted(labels, key=_BEST)[:n]
        ids = set(map(id, kept))
        if self.k > 1:
            mine: list[_Label] = []  # the plain programme's: by plain time, then memory
            for lab in sorted(labels, key=_PLAIN):
                p, m = lab.plain, lab.memory
                for o in mine:
                    if o.plain <= p and o.memory <= m:
                        break
                else:
                    mine.append(lab)
                    if id(lab) not in ids:
                        kept.append(lab)
                        ids.add(id(lab))
                    if len(mine) == n:
                        break
        for extra in (min(labels, key=_MEMORY), min(labels, key=_COST)):
            if id(extra) not in ids:
                kept.append(extra)
                ids.add(id(extra))
        return kept

    def _quotas(self) -> list[tuple[str, int]]:
        """How prune() fills the beam: (label field, states kept once it is done), in turn."""
        n = self.beam - 1
        if self.k == 1:
            return [("best", n), ("memory", n + 1)]
        best, cheapest = _BEAM_SHARES
        return [("best", round(n * best)), ("cost", round(n * (best + cheapest))),
                ("plain", n), ("memory", n + 1)]
