"""What the simulated streams share: a rank's device (compute and communication streams slow
each other: interference) and the machines' inter-node links (transfers crossing one share it).
Each re-times the SimPy processes it affects, by interrupting them, whenever its load changes, in
the order they began (dicts, not sets: a set's order follows the processes' addresses, which
changes from run to run which rank's interrupt comes first, and so which rank draws which kernel
time under simulator.montecarlo's noise)."""
from __future__ import annotations


def retime(process) -> None:
    """Interrupt `process` so that it re-reads its rate, once: several changes in one instant
    (a 2-D mesh's columns ending together) must not leave a second interrupt pending for after it
    has finished its work. The process clears `retiming` when it takes the interrupt."""
    if process.is_alive and not getattr(process, "retiming", False):
        process.retiming = True
        process.interrupt()


class Device:
    """Which streams of one rank are running, so that each kind can re-time the other."""

    def __init__(self):
        self.running: dict[str, dict] = {"compute": {}, "comm": {}}  # processes, in order

    def busy(self, kind: str) -> bool:
        return bool(self.running[kind])

    def begin(self, kind: str, process) -> None:
        self._toggle(kind, lambda: self.running[kind].setdefault(process))

    def end(self, kind: str, process) -> None:
        self._toggle(kind, lambda: self.running[kind].pop(process, None))

    def _toggle(self, kind: str, change) -> None:
        was = self.busy(kind)
        change()
        if was != self.busy(kind):  # the other kind's rate changes now
            other = "compute" if kind == "comm" else "comm"
            for process in list(self.running[other]):
                retime(process)


class Links:
    """The links that group transfers cross and the transfers crossing them: an inter-node link
    is a machine's link to the others; a group inside one machine has a link of its own, which
    its own transfers in flight at once share. A transfer alone on its links runs at full speed;
    while several cross one, each runs at 1/D of its speed, D being the sum of their demands
    (Profile.link_demand: 1 each is fair sharing, 1/n for n transfers) on its busiest link."""

    def __init__(self):
        self.members: dict[tuple, dict] = {}  # transfer -> its ranks' running processes, in order
        self.crossed: dict[tuple, tuple] = {}  # transfer -> the links it crosses
        self.demand: dict[tuple, dict] = {}  # transfer -> {link: (transfers, demand)} it adds
        self.load: dict = {}  # link -> (transfers crossing it, the sum of their demands)

    def share(self, key: tuple) -> float:
        """The speed of transfer `key` now, as a fraction of its speed alone."""
        return min(1.0 if self.load[link][0] == 1 else 1.0 / max(1.0, self.load[link][1])
                   for link in self.crossed[key])

    def begin(self, key: tuple, links: tuple, demand: float | dict, process) -> None:
        """`demand`: the transfer's on each link, or {link: (transfers, their demands)} where
        one transfer stands for the others that cross its links at the same time (the groups of
        a collective on symmetric ranks, simulator.engine._copies)."""
        if key not in self.members:  # a new transfer loads the links: the others slow down
            added = demand if isinstance(demand, dict) else {link: (1, demand) for link in links}
            self.members[key], self.crossed[key], self.demand[key] = {}, links, added
            for link in links:
                count, total = self.load.get(link, (0, 0.0))
                self.load[link] = (count + added[link][0], total + added[link][1])
            self._retime(links)
        self.members[key].setdefault(process)

    def end(self, key: tuple, process) -> None:
        self.members[key].pop(process, None)
        if not self.members[key]:  # its last rank is done: the others speed up
            del self.members[key]
            links, added = self.crossed.pop(key), self.demand.pop(key)
            for link in links:
                count, total = self.load[link]
                self.load[link] = (count - added[link][0], total - added[link][1])
            self._retime(links)

    def _retime(self, links: tuple) -> None:
        for key, processes in self.members.items():
            if set(self.crossed[key]) & set(links):
                for process in processes:
                    retime(process)
