"""Profiles: a cluster's cost figures (device throughput, per-kernel overhead, per link tier and
collective kind a latency per step and a bus bandwidth, interference factors), and the cost model
that times a Program's tasks with them (the planner and the simulator). A profile's versioned JSON
file, the shipped profiles and their checks: hidup.planning.profile_file.

Collectives follow NCCL's ring formulas on a group of n ranks: all-gather, reduce-scatter and
all-to-all take (n-1) steps and move (n-1)/n of the tensor per rank; all-reduce takes the cheaper
of a ring (2(n-1) steps, 2(n-1)/n of the tensor) and a tree (2 ceil(log2 n) steps, twice the
tensor). A group inside one machine uses the intra-node tier; a group that spans machines is
bound by the inter-node tier, whose bus bandwidth is each machine's link to the others: groups
crossing it at the same time share it (the simulator divides the transfer part among them).

A measured profile also keeps the collective times it was fitted to (`collective_points`): a
collective of a measured kind and group size takes the time interpolated between the measured
sizes (beyond the largest, the last two points' slope), split into latency and transfer as the
fit splits it. The fit alone smooths over what a real stack does at some sizes (gloo on a
rate-limited link ran 13-26% slower at 16-32 MB than the fit said). A group of one rank on each
of several machines (a 2-D mesh's column) takes its own measured times where the profile has
them: the inter-node fit, from groups of consecutive ranks, said 116 ms for an 8 MB all-reduce
over two such columns at once on the emulated 2 x 2 cluster, which took 140 ms."""
from __future__ import annotations

import json
import math
import statistics
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from functools import cached_property, lru_cache

from hidup.program.tasks import LOCAL_KERNELS, Compute, Convert, Wait, kernel_tasks

PROFILE_FORMAT, PROFILE_VERSION = "hidup-profile", 2  # of the file Profile.to_dict describes
# the profile file's optional keys (what each holds: hidup.planning.profile_file), which to_dict
# leaves out where the profile has none
OPTIONAL_KEYS = {"provenance", "kernels", "collective_points", "kernel_quantiles", "host",
                 "device_memory", "kernels_in_situ", "comm_lanes", "pair_points", "precision",
                 "device"}
# two collectives in flight take at least as long as the larger alone and, measured, never more
# than twice as long as one after the other: ratios outside are noise
PAIR_RATIO_MIN, PAIR_RATIO_MAX = 0.5, 2.0


@lru_cache(maxsize=4096)  # the search asks it for the same few groups tens of thousands of times
def _machines(group: tuple[int, ...], gpus_per_node: int) -> tuple[int, ...]:
    nodes = sorted({rank // gpus_per_node for rank in group})
    return tuple(nodes) if len(nodes) > 1 else ()


def _by_identity(cache: dict, key: tuple, make):
    """`make()`, kept in `cache` for this very tuple `key` (by its id, the tuple held beside the
    value so that its id is not reused; at most IDENTITY_CACHE of them, the oldest dropped):
    a world's worth of ranks is not hashed again for every collective that shares its groups."""
    hit = cache.get(id(key))
    if hit is None or hit[0] is not key:
        hit = cache[id(key)] = (key, make())
        if len(cache) > IDENTITY_CACHE:
            cache.pop(next(iter(cache)))
    return hit[1]


IDENTITY_CACHE = 32


class ProfileError(ValueError):
    """A profile file is missing, unreadable or not a valid HiDup profile
    (hidup.planning.profile_file), or a profile lacks the figures asked of it."""


@dataclass(frozen=True)
class LinkCost:
    """One collective kind on one link tier: latency per algorithm step, and bus bandwidth."""

    alpha: float  # seconds per step
    beta: float  # bus bandwidth, bytes per second

    def time(self, kind: str, nbytes: float, n: int) -> float:
        """Seconds for a group of n ranks on a tensor of nbytes (the whole tensor)."""
        return sum(self.split(kind, nbytes, n))

    def split(self, kind: str, nbytes: float, n: int) -> tuple[float, float]:
        """(latency, transfer) seconds: the steps' latency, and the bytes at the bus bandwidth
        (the part that groups sharing a link share)."""
        if n <= 1:
            return 0.0, 0.0
        if kind == "all_reduce":
            ring = 2 * (n - 1) * self.alpha, 2 * (n - 1) / n * nbytes / self.beta
            tree = 2 * math.ceil(math.log2(n)) * self.alpha, 2 * nbytes / self.beta
            return min(ring, tree, key=sum)
        return (n - 1) * self.alpha, (n - 1) / n * nbytes / self.beta

    def __str__(self) -> str:
        return f"{self.alpha * 1e6:g} us/step, {self.beta / 1e9:g} GB/s bus"


@dataclass(frozen=True)
class Profile:
    """The figures of one cluster and where they come from."""

    name: str
    source: str
    flops: float  # device FLOP/s
    mem_bandwidth: float  # bytes/s
    op_overhead: float  # seconds per kernel
    collectives: dict[str, LinkCost] = field(hash=False)  # the intra-node tier
    gpus_per_node: int = 1
    inter_node: dict[str, LinkCost] | None = field(default=None, hash=False)
    interference_compute: float = 1.0  # kernels run this much longer while a collective runs
    interference_comm: float = 1.0  # collectives run this much longer while a kernel runs
    provenance: dict | None = field(default=None, hash=False, compare=False)
    kernels: dict[str, float] | None = field(default=None, hash=False, compare=False)
    collective_points: list[list] | None = field(default=None, hash=False, compare=False)
    kernel_quantiles: dict[str, list[float]] | None = field(default=None, hash=False,
                                                            compare=False)
    host: dict[str, float] | None = field(default=None, hash=False, compare=False)  # mode ->
    #   seconds the host spends issuing one task on a GPU, where kernels run asynchronously
    #   after it; absent on a CPU cluster, whose host runs the kernels (their times include it)
    device_memory: float | None = field(default=None, hash=False, compare=False)  # bytes
    kernels_in_situ: bool = field(default=False, hash=False, compare=False)  # `kernels` timed
    #   in real steps (their interference included)
    interference_latency: float | None = None  # a collective's latency (its steps' fixed cost:
    #   waking the transport's threads, round trips) runs this much longer while a kernel runs,
    #   measured with small all-reduces; None: as interference_comm (measured with large ones)
    comm_lanes: int = field(default=1, hash=False, compare=False)  # collectives in flight at
    #   once on a rank
    pair_points: list[list] | None = field(default=None, hash=False, compare=False)
    precision: str = field(default="fp32", compare=False)  # what its kernels were timed at and
    #   plans are made for unless told otherwise: 'fp32' or 'bf16' (autocast)
    device: str = field(default="cuda", compare=False)  # its devices' type as torch names it,
    #   whose autocast policy gives the values' dtypes: 'cuda' or 'cpu'

    @property
    def latency_slowdown(self) -> float:
        """How much longer a collective's latency runs while a kernel runs."""
        return self.interference_comm if self.interference_latency is None else \
            self.interference_latency

    def check_world(self, gpus: int) -> None:
        """Refuse a world size the profile cannot describe: GPUs beyond one machine where it has
        no figures for the link between machines."""
        if gpus > self.gpus_per_node and self.inter_node is None:
            raise ProfileError(
                f"cluster {self.name} describes machines of {self.gpus_per_node} GPU(s) and has "
                f"no figures for a link between machines, so {gpus} GPUs cannot be placed on it; "
                f"use --gpus {self.gpus_per_node} or fewer, a multi-machine profile (such as "
                f"v100-2x4 or v100-8x8-10gbps), or derive one: python -m calibration.derive "
                f"--base {self.name} --inter-bandwidth 10gbit --name NAME --out NAME.json")

    def fits(self, peak_bytes: float) -> bool | None:
        """Whether a rank's peak memory fits a device (None: the profile does not say)."""
        return None if self.device_memory is None else peak_bytes <= self.device_memory

    def issue_time(self, task: Compute | Convert | Wait, mode: str) -> float | None:
        """Seconds the host spends issuing `task` in executor `mode`: None when the profile has
        no host figures (a CPU cluster: the host is the compute stream), 0 for an alias (it
        issues nothing). A mode the profile has no figure for is an error that names them."""
        if self.host is None:
            return None
        if mode not in self.host:
            raise ProfileError(f"profile {self.name} has host figures for executor modes "
                               f"{sorted(self.host)}, not {mode!r}; calibrate that mode on "
                               f"the GPU or pick one of those")
        return self.host[mode] if issues(task) else 0.0

    def compute_time(self, task: Compute | Convert) -> float:
        """Seconds of a kernel on a compute stream: a Compute, or a local slice / alias. A kernel
        measured on this cluster (`kernels`, by kernel_key) takes its measured time."""
        if self.kernels:
            measured = self.kernels.get(kernel_key(task))
            if measured is not None:
                return measured
        if isinstance(task, Compute):
            return self.kernel_time(task.flops, task.bytes)
        if task.kind == "alias":
            return 0.0
        if task.kind in LOCAL_KERNELS:  # a copy of its bytes
            return self.op_overhead + task.bytes / self.mem_bandwidth
        raise ProfileError(f"task {task} is a collective, not a compute-stream kernel")

    def host_times(self, task: Convert) -> tuple[float, float]:
        """Seconds a collective keeps its issuing stream busy before it is handed over (packing
        its input) and at its first Wait (unpacking the result): measured ones (`kernels`, on a
        CPU cluster, where the host is the device), else none (a GPU's launch is asynchronous)."""
        if not self.kernels:
            return 0.0, 0.0
        key = kernel_key(task)
        return self.kernels.get(f"issue {key}", 0.0), self.kernels.get(f"finish {key}", 0.0)

    def call_time(self, task: Convert) -> float:
        """Seconds of a collective's issuing (host_times' first figure) spent in the call that
        hands it to the network, measured in real steps by calibration.ops ('call KEY'; on a
        CPU gloo's threads start the transfer on the step's cores); 0 where not measured. The
        collective's own time (collective_split: calibration.profile times calls that block)
        already includes it."""
        return (self.kernels or {}).get(f"call {kernel_key(task)}", 0.0)

    def network_split(self, task: Convert, group: tuple[int, ...]) -> tuple[float, float]:
        """(latency, transfer) seconds of collective `task` over `group` once it is issued:
        collective_split less the call that its issuing stream was already charged (from the
        latency first, then the transfer; never below zero)."""
        latency, transfer = self.collective_split(task.kind, task.bytes, group)
        call = self.call_time(task)
        cut = min(call, latency)
        return latency - cut, max(0.0, transfer - (call - cut))

    def drawn_time(self, key: str, seconds: float, u: float) -> float:
        """A kernel's seconds in one run: at quantile `u` (in [0, 1)) of its measured spread
        (`kernel_quantiles`), or `seconds` where none was measured."""
        spread = (self.kernel_quantiles or {}).get(key)
        return spread[int(u * len(spread))] if spread else seconds

    def kernel_time(self, flops: float, nbytes: float) -> float:
        """Seconds of one kernel: launch overhead, then bound by FLOPs or by memory traffic."""
        return self.op_overhead + max(flops / self.flops, nbytes / self.mem_bandwidth)

    def collective_time(self, kind: str, nbytes: float, group: tuple[int, ...]) -> float:
        """Seconds of one collective of `kind` on a tensor of `nbytes` over the ranks `group`."""
        return sum(self.collective_split(kind, nbytes, group))

    def collective_split(self, kind: str, nbytes: float,
                         group: tuple[int, ...]) -> tuple[float, float]:
        """(latency, transfer) seconds of one collective alone on its links (LinkCost.split)."""
        tier = self.tier(group)
        if kind not in tier:
            raise ProfileError(f"profile {self.name} has no figures for collective {kind!r}; "
                               f"add it under \"collectives\"")
        latency, transfer = tier[kind].split(kind, nbytes, len(group))
        curve = next((self._curves[t, kind, len(group)] for t in self._tiers(group)
                      if (t, kind, len(group)) in self._curves), None)
        if curve is None or latency + transfer <= 0:
            return latency, transfer
        scale = _interpolate(curve, nbytes) / (latency + transfer)
        return latency * scale, transfer * scale

    @cached_property
    def _curves(self) -> dict[tuple[str, str, int], tuple[list[float], list[float]]]:
        """(tier, kind, n) -> measured (sizes, seconds), sorted by size; two sizes at least."""
        by: dict[tuple[str, str, int], dict[float, float]] = {}
        for tier, kind, n, nbytes, seconds in self.collective_points or ():
            by.setdefault((tier, kind, int(n)), {})[float(nbytes)] = float(seconds)
        return {key: (sorted(pts), [pts[b] for b in sorted(pts)])
                for key, pts in by.items() if len(pts) >= 2}

    def link_demand(self, kind: str, nbytes: float, group: tuple[int, ...]) -> float:
        """How much of the links a transfer of collective `kind` over `group` takes, from the
        measured pairs (`pair_points`): two such transfers at once on a link each run at
        1/(2 x demand) of their speed alone, so that both together take `ratio` times as long as
        one after the other (simulator.resources.Links adds up the demands of all transfers on a
        link). Interpolated between the measured sizes, the nearest size's beyond them; 1.0
        (fair sharing: n transfers, each at 1/n) where the profile has no pairs of that kind."""
        curve = next((self._pairs[t, kind] for t in self._tiers(group) if (t, kind) in self._pairs),
                     None)
        if curve is None:
            return 1.0
        sizes, ratios = curve
        if nbytes <= sizes[0] or len(sizes) == 1:
            return ratios[0]
        if nbytes >= sizes[-1]:
            return ratios[-1]
        i = bisect_left(sizes, nbytes)
        x = (math.log(nbytes) - math.log(sizes[i - 1])) / (math.log(sizes[i]) -
                                                            math.log(sizes[i - 1]))
        return ratios[i - 1] + x * (ratios[i] - ratios[i - 1])

    def _tiers(self, group: tuple[int, ...]) -> tuple[str, ...]:
        """The tiers of measured figures (collective_points, pair_points) that describe a group,
        the first measured one counting: inside one machine the intra-node ones; one rank on each
        of several machines (a mesh column) the column's, else the inter-node ones; any other
        group across machines the inter-node ones."""
        crossed = self.machines(group)
        if not crossed:
            return ("intra",)
        return ("column", "inter") if len(crossed) == len(group) else ("inter",)

    @cached_property
    def _pairs(self) -> dict[tuple[str, str], tuple[list[float], list[float]]]:
        """(tier, kind) -> measured (sizes, ratios) of two in flight, sorted by size; each ratio
        within [PAIR_RATIO_MIN, PAIR_RATIO_MAX] (the median where several group sizes were
        measured at one size)."""
        by: dict[tuple[str, str], dict[float, list[float]]] = {}
        for tier, kind, _n, nbytes, ratio in self.pair_points or ():
            by.setdefault((tier, kind), {}).setdefault(float(nbytes), []).append(float(ratio))
        out = {}
        for key, pts in by.items():
            sizes = sorted(pts)
            out[key] = (sizes, [min(PAIR_RATIO_MAX, max(PAIR_RATIO_MIN, statistics.median(pts[b])))
                                for b in sizes])
        return out

    def machines(self, group: tuple[int, ...]) -> tuple[int, ...]:
        """The machines whose inter-node link a group crosses (none if it stays in one)."""
        if not self.inter_node:
            return ()
        if len(group) <= self.gpus_per_node:  # (cheap: not worth a cache entry)
            return _machines(group, self.gpus_per_node)
        return _by_identity(self.__dict__.setdefault("_groups_machines", {}), group,
                            lambda: _machines(group, self.gpus_per_node))

    def mesh(self, gpus: int) -> tuple[int, int]:
        """The default device mesh of `gpus` on this cluster: its machines x GPUs per machine
        when `gpus` fills whole machines (2-D), else (1, gpus)."""
        per = self.gpus_per_node
        if gpus > per and gpus % per == 0:
            return gpus // per, per
        return 1, gpus

    def link_load(self, group: tuple[int, ...], parts: tuple[tuple[int, ...], ...]) -> int:
        """How many of a collective's groups `parts` (run at once, one per rank) cross the
        busiest inter-node link that `group` crosses: they share it, each at 1/n of its speed
        (a 2-D mesh's columns on one machine's card); 1 for a group inside one machine."""
        mine = self.machines(group)
        if not mine or len(parts) < 2:
            return 1
        crossing, loads = self._crossing(parts)
        return _by_identity(loads, group, lambda: max(crossing.get(m, 0) for m in mine))

    def _crossing(self, parts: tuple[tuple[int, ...], ...]) -> tuple[dict[int, int], dict]:
        """(machine -> how many of the groups `parts` cross its link, link_load's answers for
        the groups asked about); worked out once per `parts` object (a lowering's collectives
        share their mesh's groups, and hashing a world's worth of ranks for each would cost as
        much as counting them again)."""
        def count() -> tuple[dict[int, int], dict]:
            counts: dict[int, int] = {}
            for g in parts:
                for m in self.machines(g):
                    counts[m] = counts.get(m, 0) + 1
            return counts, {}
        return _by_identity(self.__dict__.setdefault("_crossings", {}), parts, count)

    def tier(self, group: tuple[int, ...]) -> dict[str, LinkCost]:
        """The intra-node figures, or the inter-node ones if the group spans machines."""
        return self.inter_node if self.machines(group) else self.collectives

    def to_dict(self) -> dict:
        doc = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION}
        doc.update(asdict(self))
        doc["interference"] = {"compute": doc.pop("interference_compute"),
                               "communication": doc.pop("interference_comm")}
        latency = doc.pop("interference_latency")
        if latency is not None:
            doc["interference"]["latency"] = latency
        for tier in ("collectives", "inter_node"):
            if doc[tier] is not None:
                doc[tier] = {k: {"alpha": c["alpha"], "bus_bandwidth": c["beta"]}
                             for k, c in doc[tier].items()}
        for key in OPTIONAL_KEYS:
            if doc[key] is None or doc[key] is False or (key == "comm_lanes" and doc[key] == 1) \
                    or (key, doc[key]) in (("precision", "fp32"), ("device", "cuda")):
                del doc[key]
        return doc

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def __str__(self) -> str:
        links = ", ".join(f"{k} {c}" for k, c in self.collectives.items())
        return (f"profile {self.name}: {self.flops / 1e12:g} TFLOP/s, "
                f"{self.mem_bandwidth / 1e9:g} GB/s memory, {self.op_overhead * 1e6:g} us/kernel, "
                f"{self.gpus_per_node} GPUs/node; {links}")


def _interpolate(curve: tuple[list[float], list[float]], nbytes: float) -> float:
    """Seconds at nbytes on a measured curve: linear between the neighbouring sizes, the
    smallest size's time below it, the last segment's slope (never negative) beyond it."""
    sizes, times = curve
    if nbytes <= sizes[0]:
        return times[0]
    i = min(bisect_left(sizes, nbytes), len(sizes) - 1)
    slope = max(0.0, (times[i] - times[i - 1]) / (sizes[i] - sizes[i - 1]))
    return times[i - 1] + (nbytes - sizes[i - 1]) * slope


def kernel_key(task: Compute | Convert) -> str:
    """What identifies a kernel's cost: phase, op, local shapes (and which input gradients a
    backward computes; the parameters' size for the optimizer step; a slice's dimension)."""
    if isinstance(task, Convert) and task.collective:
        return f"{task.kind} {list(task.shape)} {task.bytes}"
    if isinstance(task, Convert):
        return f"{task.kind} {list(task.shape)} {getattr(task.dst, 'dim', '')}".rstrip()
    if task.phase == "update":
        return f"update {task.op} {task.flops:.0f}"
    shapes = ",".join(str(list(s)) for s in task.in_shapes)
    phase = "fwd" if task.phase == "recompute" else task.phase  # the same kernel again
    key = f"{phase} {task.op} {shapes}->{list(task.out_shape)}"
    if task.phase == "bwd":
        key += " grads " + "".join("1" if out else "0" for out in task.outputs)
    return key


def issues(task: Compute | Convert | Wait) -> bool:
    """Whether a host issues anything for the task (an alias only renames a tensor)."""
    return not (isinstance(task, Convert) and task.kind == "alias")


def timing_key(task: Compute | Convert | Wait, tasks) -> str:
    """The key under which calibration.ops records a compute-stream task's time: a kernel's
    own key, a collective's packing 'issue KEY', and at a Wait its unpacking 'finish KEY' (of
    collective `tasks[task.collective]`)."""
    if isinstance(task, Wait):
        return f"finish {kernel_key(tasks[task.collective])}"
    if isinstance(task, Convert) and task.collective:
        return f"issue {kernel_key(task)}"
    return kernel_key(task)


def kernel_coverage(profile: Profile, tasks) -> float:
    """Share of the compute-stream kernels among `tasks` that have a measured time."""
    kernels = kernel_tasks(tasks)
    if not kernels:
        return 1.0
    return sum(kernel_key(t) in (profile.kernels or {}) for t in kernels) / len(kernels)

