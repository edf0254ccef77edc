"""What the simulated streams share: a rank's device (compute and communication streams slow
each other: interference) and the machines' inter-node links (transfers crossing one share it).
Each re-times the SimPy processes it affects, by interrupting them, whenever its load changes."""
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
        self.running: dict[str, set] = {"compute": set(), "comm": set()}

    def busy(self, kind: str) -> bool:
        return bool(self.running[kind])

    def begin(self, kind: str, process) -> None:
        self._toggle(kind, lambda: self.running[kind].add(process))

    def end(self, kind: str, process) -> None:
        self._toggle(kind, lambda: self.running[kind].discard(process))

    def _toggle(self, kind: str, change) -> None:
        was = self.busy(kind)
        change()
        if was != self.busy(kind):  # the other kind's rate changes now
            other = "compute" if kind == "comm" else "comm"
            for process in list(self.running[other]):
                retime(process)


class Links:
    """The machines' inter-node links and the group transfers crossing them: a transfer runs at
    1/n of its speed while n transfers cross the busiest of its links (fair sharing)."""

    def __init__(self):
        self.members: dict[tuple, set] = {}  # transfer -> its ranks' running processes
        self.machines: dict[tuple, tuple[int, ...]] = {}
        self.load: dict[int, int] = {}  # machine -> transfers crossing its link

    def share(self, key: tuple) -> float:
        return 1.0 / max(self.load[m] for m in self.machines[key])

    def begin(self, key: tuple, machines: tuple[int, ...], process) -> None:
        if key not in self.members:  # a new transfer loads the links: the others slow down
            self.members[key], self.machines[key] = set(), machines
            for m in machines:
                self.load[m] = self.load.get(m, 0) + 1
            self._retime(machines)
        self.members[key].add(process)

    def end(self, key: tuple, process) -> None:
        self.members[key].discard(process)
        if not self.members[key]:  # its last rank is done: the others speed up
            del self.members[key]
            machines = self.machines.pop(key)
            for m in machines:
                self.load[m] -= 1
            self._retime(machines)

    def _retime(self, machines: tuple[int, ...]) -> None:
        for key, processes in self.members.items():
            if set(self.machines[key]) & set(machines):
                for process in processes:
                    retime(process)
