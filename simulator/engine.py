"""The SimPy model of one training step: every rank runs the Program's tasks on one compute stream
and one communication stream, in program order, with the executor's ordering rules.

Per rank: the compute stream runs the Compute tasks and local conversions (slice, alias) one after
another; a Wait blocks it until that collective has finished on the rank. The
communication stream runs the collectives in program order, the profile's `comm_lanes` of them
at once (NCCL's stream: 1; gloo's two worker threads: 2): each is handed over once the earlier
tasks that write its input have finished on the rank, starts once a lane is free (in the order
handed over) and every rank of its group has got that far (rendezvous), and then takes the same
time on all of them (none in a group of one, where the executor's collectives are the identity).
The lanes are the rank's, whichever process group a collective runs in: on this CPU cluster the
collectives of a 2-D mesh's rows and columns compete for the same cores.

A collective's time is its steps' latency, then its bytes at the link's bus bandwidth. A group
that crosses machines moves those bytes over each of its machines' inter-node link (a group inside
one machine over a link of its own); transfers that cross a link at once (the sub-groups of a
split world, Convert.groups; a group's collectives in flight together) share it: each runs at
1/D of its speed alone while the demands of the transfers on its busiest link add up to D > 1
(Profile.link_demand, measured in pairs; 1 each where not measured: n transfers at 1/n each),
re-timed whenever one starts or ends. Interference slows kernels while a collective runs on the
device and collectives while a kernel runs (the profile's factors: a collective's latency by its
own, as small messages suffer more from busy cores than large transfers).

Where the profile has host figures (a GPU: `Profile.host`, seconds per task for the executor mode
that runs), each rank also has a host thread that issues its tasks in program order, each taking
that long; a kernel or collective cannot start before it is issued, so a step of small kernels is
as slow as its host (and Duplex, with twice the tasks, doubles the host's work). A Wait blocks
only the stream there, never the host. On a CPU cluster (no host figures) the host is the compute
stream: it runs the kernels, and a Wait blocks it.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace

import simpy

from hidup.planning.costs import Profile, timing_key
from hidup.planning.fusion import kernel_times
from hidup.program import Compute, Convert, Program, Wait
from hidup.program.recompute import dropped
from simulator.records import (
    COMM_STREAM,
    COMPUTE_STREAM,
    HOST,
    Record,
    Result,
    SimulationError,
    step_result,
)
from simulator.resources import Device, Links

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Plan:
    """What every rank does, worked out once: the compute queue, durations, collectives'
    producers."""

    compute: tuple[Compute | Convert | Wait, ...]  # the compute stream's tasks, in order
    collectives: tuple[Convert, ...]
    producers: dict[int, tuple[int, ...]]  # collective id -> earlier tasks writing its input
    duration: dict[int, float]  # compute-stream tasks
    links: dict[tuple[int, int], tuple[float, float, tuple, float]]  # (collective, group
    #   index) -> (latency, transfer, the links it crosses (resources.Links), its demand on them)
    part: dict[tuple[int, int], int]  # (collective, rank) -> index of the rank's group, for
    #   collectives split into sub-groups (others: 0)
    host: dict[int, tuple[float, float]]  # collective id -> seconds its stream spends issuing
    #   it and at its first Wait (Profile.host_times; only those not zero)
    issue: tuple[tuple[Compute | Convert | Wait, float], ...] | None  # every task in program
    #   order and the seconds the host thread spends issuing it (a GPU profile's host figures;
    #   None: no host thread)
    in_situ: frozenset[int]  # compute-stream tasks whose measured time was taken in real steps
    #   (Profile.kernels_in_situ): interference is already in it
    lanes: int = 1  # collectives in flight at once on a rank (Profile.comm_lanes)
    copies: dict[int, dict] | None = None  # simulating rank 0 for all (_copies): for each
    #   collective, the links its group 0 crosses -> (how many of its groups cross that link,
    #   the sum of their demands); None: every rank is simulated, each group's transfer its own

    @property
    def identical(self) -> bool:
        """Every collective spans the world: all ranks do and wait for the same."""
        return all(len(c.parts) == 1 for c in self.collectives)

    @property
    def shared_links(self) -> bool:
        """Transfers can load a link together: a group's collectives in flight at once, or
        several groups of one collective crossing machines."""
        return self.lanes > 1 or any(
            len(c.parts) > 1 and any(self.links[c.id, i][2][0] != "group"
                                     for i in range(len(c.parts)))
            for c in self.collectives)


def simulate(program: Program, profile: Profile, all_ranks: bool = False,
             slow_ranks: dict[int, float] | None = None,
             noise: random.Random | None = None, mode: str = "graph") -> Result:
    """Run one step of `program` and measure it. Every rank runs the same tasks; when every
    collective spans the world the ranks are identical and one is simulated (all_ranks=True
    simulates each of them, to the same result); so are ranks that are symmetric (sub-groups
    alike on machines alike: _copies), rank 0's transfers loading the links as all the groups
    of their collective do; other sub-group collectives simulate every rank.
    `slow_ranks` {rank: factor} makes those ranks' kernels take `factor` times longer
    (stragglers, noise): every rank is simulated then, and collectives wait at the rendezvous
    for the slowest member. With `noise`, each rank's run of each measured kernel takes a time
    drawn from its measured spread (Profile.kernel_quantiles), every rank simulated: one sample of
    a step as ranks whose kernels vary meet at each collective (simulator.montecarlo). `mode` is
    the executor mode (hidup.program.HOST_MODES; 'eager': plain PyTorch) whose host figures the
    profile gives, if it has any."""
    slow = dict(slow_ranks or {})
    bad = {r: f for r, f in slow.items() if not (0 <= r < program.world) or f <= 0}
    if bad:
        raise SimulationError(f"slow_ranks {bad}: ranks must be in 0..{program.world - 1} and "
                              f"factors positive")
    asked = bool(all_ranks or slow or noise)  # every rank simulated, alike or not
    plan = _plan(program, profile, mode, every_rank=asked)
    ranks = program.world if asked or (plan.copies is None and not plan.identical) else 1
    env = simpy.Environment()
    sim = _Sim(env, plan, ranks, profile, slow, noise)
    started, events = time.perf_counter(), _run(env)
    elapsed = time.perf_counter() - started
    log.debug("simulated %s k=%d on %d ranks: %d events in %.3f s (%.0f events/s)",
              program.strategy, program.k, program.world, events, elapsed,
              events / max(elapsed, 1e-9))
    sim.check_finished()
    return replace(step_result(sim.records), events=events)


def _run(env: simpy.Environment) -> int:
    """Process every scheduled event; return how many there were."""
    events = 0
    try:
        while True:
            env.step()
            events += 1
    except simpy.core.EmptySchedule:
        return events


def _plan(program: Program, profile: Profile, mode: str = "graph",
          every_rank: bool = False) -> _Plan:
    """What every rank does. Unless `every_rank`, where the ranks are symmetric (_copies) the
    plan is for simulating rank 0 alone: only its groups' links are worked out."""
    collectives = tuple(program.collectives)
    copies = None if every_rank else _copies(collectives, profile)
    ids = {c.id for c in collectives}
    compute: list = []
    seconds, gone = kernel_times(program, profile, mode), dropped(program)
    duration: dict[int, float] = {}
    links, part, host = {}, {}, {}
    for task in program.tasks:
        if isinstance(task, Convert) and task.collective:
            _check_groups(task, program.world)
            pack_unpack = profile.host_times(task)
            if any(pack_unpack):
                host[task.id] = pack_unpack
                if pack_unpack[0] > 0:  # issuing it takes the compute stream's time
                    compute.append(task)
            for i, group in enumerate(task.parts[:1] if copies is not None else task.parts):
                links[task.id, i] = (*profile.network_split(task, group), _crossed(profile, group),
                                     profile.link_demand(task.kind, task.bytes, group))
                if len(task.parts) > 1 and copies is None:  # (world-spanning: all in group 0)
                    part.update({(task.id, rank): i for rank in group})
            continue
        if isinstance(task, Wait) and task.collective not in ids:
            raise SimulationError(f"task {task}: #{task.collective} is not a collective of "
                                  f"program {program.model} {program.strategy}")
        if not isinstance(task, Wait):
            duration[task.id] = seconds.get(task.id, 0.0)
        compute.append(task)
    issue = None if profile.host is None else \
        tuple((t, 0.0 if t.id in gone else profile.issue_time(t, mode)) for t in program.tasks)
    measured = set(profile.kernels or ()) if profile.kernels_in_situ else set()
    by_id = {c.id: c for c in collectives}
    in_situ = frozenset(t.id for t in compute if measured and timing_key(t, by_id) in measured)
    return _Plan(tuple(compute), collectives, _producers(program), duration, links, part, host,
                 issue, in_situ, profile.comm_lanes,
                 None if copies is None or all(len(c.parts) == 1 for c in collectives) else copies)


def _copies(collectives: tuple[Convert, ...], profile: Profile) -> dict[int, dict] | None:
    """Where the ranks are symmetric, for each collective the load its groups put on each link
    its group 0 crosses ({link: (groups crossing it, the sum of their demands)}); None where they
    are not. Symmetric: in every collective the groups are of one size, each crosses as many
    links, and every link any of them crosses carries the same load from it (a mesh's rows,
    columns or whole world on machines of equal size). Every rank then runs the same tasks at the
    same times, the groups of a collective in flight together, and rank 0 alone, its transfers
    loading each link as all the groups do, shows them all (tests/test_simulator_fidelity.py
    holds it to simulating every rank)."""
    out, seen = {}, {}
    for task in collectives:
        key = task.kind, task.bytes, task.parts
        if key not in seen:
            seen[key] = _group_load(task, profile)
        if seen[key] is None:
            return None
        out[task.id] = seen[key]
    return out


def _group_load(task: Convert, profile: Profile) -> dict | None:
    """_copies' load of one collective, or None if its groups are not alike."""
    if len({len(g) for g in task.parts}) > 1:
        return None
    load: dict = {}
    crossed = [_crossed(profile, g) for g in task.parts]
    if len({len(c) for c in crossed}) > 1:
        return None
    demands = {profile.link_demand(task.kind, task.bytes, g) for g in task.parts}
    if len(demands) > 1:
        return None
    demand = demands.pop()
    for links in crossed:
        for link in links:
            count, total = load.get(link, (0, 0.0))
            load[link] = count + 1, total + demand
    if len(set(load.values())) > 1:
        return None
    return {link: load[link] for link in crossed[0]}


def _crossed(profile: Profile, group: tuple[int, ...]) -> tuple:
    """The links a group's transfers cross: its machines' inter-node links, or, inside one
    machine, a link of the group's own ("group", ranks)."""
    return profile.machines(group) or (("group", group),)


def _check_groups(task: Convert, world: int) -> None:
    ranks = sorted(r for group in task.parts for r in group)
    if ranks != list(range(world)) or task.group not in task.parts:
        raise SimulationError(f"task {task}: groups {task.parts} do not split the {world} ranks "
                              f"into disjoint groups with rank 0's first; every rank runs every "
                              f"task, so each rank must be in exactly one group")


def _producers(program: Program) -> dict[int, tuple[int, ...]]:
    """For each collective, the earlier tasks (any kind) whose outputs include one of its inputs."""
    writers: dict[str, list[int]] = {}
    out: dict[int, tuple[int, ...]] = {}
    for task in program.tasks:
        if isinstance(task, Wait):
            continue
        if isinstance(task, Convert) and task.collective:
            out[task.id] = tuple(w for key in task.inputs for w in writers.get(key, ()))
        for key in task.outputs:
            if key:
                writers.setdefault(key, []).append(task.id)
    return out


class _Sim:
    """The SimPy processes of all ranks: a compute stream and a communication stream each."""

    def __init__(self, env: simpy.Environment, plan: _Plan, ranks: int, profile: Profile,
                 slow: dict[int, float] | None = None, noise: random.Random | None = None):
        self.env, self.plan, self.ranks, self.slow = env, plan, ranks, slow or {}
        self.profile, self.noise = profile, noise
        self.collective_of = {c.id: c for c in plan.collectives}  # for a Wait's timing key
        tasks = [*plan.duration, *(c.id for c in plan.collectives)]
        self.done = {(r, i): env.event() for r in range(ranks) for i in tasks}
        self.issued = {(r, i): env.event() for r in range(ranks) for i in plan.host
                       if plan.host[i][0] > 0}
        self.unpacked: set[tuple[int, int]] = set()  # (rank, collective) past its first Wait
        self.arrived: dict[tuple[int, int], int] = {}
        self.barrier = {key: env.event() for key in plan.links}
        self.records: list[list[Record]] = [[] for _ in range(ranks)]
        self.slowdown = {"compute": profile.interference_compute,
                         "comm": profile.interference_comm, "latency": profile.latency_slowdown}
        self.interfere = max(self.slowdown.values()) > 1.0
        self.devices = [Device() for _ in range(ranks)]
        self.links = Links() if plan.shared_links else None
        self.lanes = [simpy.Resource(env, capacity=plan.lanes) for _ in range(ranks)]
        self.beside = [Links() for _ in range(ranks)] if plan.lanes > 1 else None  # per rank:
        #   its collectives in flight at once
        self.in_flight: list[set[int]] = [set() for _ in range(ranks)]  # lanes shown busy
        self.launched = {(r, t.id): env.event() for r in range(ranks) for t, _ in plan.issue or ()}
        for rank in range(ranks):
            env.process(self.compute_stream(rank))
            env.process(self.comm_stream(rank))
            if self.launched:
                env.process(self.host_thread(rank))

    def host_thread(self, rank: int):
        """A GPU rank's host: issues every task in program order (a Wait too: it only enqueues
        the stream's wait), each taking its issue time; recorded on the HOST track."""
        for task, seconds in self.plan.issue:
            if seconds > 0:
                start = self.env.now
                yield self.env.timeout(seconds)
                self.records[rank].append(Record(task, HOST, start, self.env.now))
            self.launched[rank, task.id].succeed()

    def compute_stream(self, rank: int):
        for task in self.plan.compute:
            if self.launched:  # a GPU's stream runs what the host has issued
                yield self.launched[rank, task.id]
            if isinstance(task, Wait):
                yield self.done[rank, task.collective]
                unpack = self.plan.host.get(task.collective, (0.0, 0.0))[1]
                if unpack > 0 and (rank, task.collective) not in self.unpacked:
                    self.unpacked.add((rank, task.collective))
                    yield from self.kernel(rank, task, unpack)
                continue
            if isinstance(task, Convert) and task.collective:  # packing its input
                yield from self.kernel(rank, task, self.plan.host[task.id][0])
                self.issued[rank, task.id].succeed()
            else:
                yield from self.kernel(rank, task, self.plan.duration[task.id])
                self.done[rank, task.id].succeed()

    def kernel(self, rank: int, task, seconds: float):
        """`seconds` of work on the compute stream (slower on a slow rank; with noise, drawn
        from the task's measured spread); recorded."""
        if self.noise is not None:
            key = timing_key(task, self.collective_of)
            seconds = self.profile.drawn_time(key, seconds, self.noise.random())
        start = self.env.now
        yield from self.run(rank, COMPUTE_STREAM, seconds * self.slow.get(rank, 1.0),
                            slowed=task.id not in self.plan.in_situ)
        self.records[rank].append(Record(task, COMPUTE_STREAM, start, self.env.now))

    def comm_stream(self, rank: int):
        """Hand each collective over, in program order, once its input is written (and packed)
        and the host has issued it; it runs in its turn on one of the rank's lanes."""
        for task in self.plan.collectives:
            inputs = [self.done[rank, i] for i in self.plan.producers[task.id]]
            if (rank, task.id) in self.issued:
                inputs.append(self.issued[rank, task.id])
            if self.launched:
                inputs.append(self.launched[rank, task.id])
            if inputs:
                yield self.env.all_of(inputs)
            key = (task.id, self.plan.part.get((task.id, rank), 0))
            turn = self.lanes[rank].request()  # granted in the order requested
            self.env.process(self.collective(rank, task, key, turn))

    def collective(self, rank: int, task: Convert, key: tuple[int, int], turn):
        """Collective `task` on one rank: its lane, the rendezvous, the latency, the transfer."""
        yield turn
        yield self.arrive(key, len(task.parts[key[1]]))
        latency, transfer, crossed, demand = self.plan.links[key]
        start, lane = self.env.now, self.take_lane(rank)
        # in flight beside the rank's others, all of it shares the rank (its threads, cores and
        # connection: two 1 MB all-reduces in flight gained nothing); its transfer also shares
        # the links it crosses with every transfer on them
        beside = ((self.beside[rank], task.id, ("lanes",), demand),) if self.beside else ()
        copies = self.plan.copies[task.id] if self.plan.copies is not None else None
        net = ((self.links, key, crossed, copies or demand),) if self.links is not None else ()
        if not beside + net and self.slowdown["latency"] == self.slowdown["comm"]:
            yield from self.run(rank, COMM_STREAM, latency + transfer)
        else:  # the latency at its own slowdown, then the transfer
            yield from self.run(rank, COMM_STREAM, latency, beside, factor="latency")
            yield from self.run(rank, COMM_STREAM, transfer, beside + net)
        turn.resource.release(turn)
        self.in_flight[rank].discard(lane)
        self.records[rank].append(Record(task, COMM_STREAM, start, self.env.now, lane))
        self.done[rank, task.id].succeed()

    def take_lane(self, rank: int) -> int:
        """The lowest lane of the rank's communication stream not showing a collective now."""
        lane = next(i for i in range(len(self.in_flight[rank]) + 1)
                    if i not in self.in_flight[rank])
        self.in_flight[rank].add(lane)
        return lane

    def arrive(self, key: tuple[int, int], size: int) -> simpy.Event:
        """This rank has reached collective `key` (id, group); the returned event fires when all
        of its group has."""
        self.arrived[key] = self.arrived.get(key, 0) + 1
        if self.arrived[key] == min(size, self.ranks):
            self.barrier[key].succeed()
        return self.barrier[key]

    def run(self, rank: int, stream: int, work: float, flows: tuple = (), slowed: bool = True,
            factor: str | None = None):
        """Run `work` seconds of full-speed work on `stream` of `rank`: at the rate the other kind
        of stream allows (interference, by the slowdown `factor` names, else the stream's own; not
        if `slowed` is false: a kernel timed in real steps) and, for a collective, its share of
        what it shares (`flows`: (Links, key, links, demand) each; the smallest share counts);
        re-timed whenever one of those changes."""
        if not self.interfere and not flows:
            yield self.env.timeout(work)
            return
        device = self.devices[rank] if self.interfere else None
        kind = "comm" if stream == COMM_STREAM else "compute"
        other = "compute" if kind == "comm" else "comm"
        me = self.env.active_process
        if device:
            device.begin(kind, me)
        for shared, key, crossed, demand in flows:
            shared.begin(key, crossed, demand, me)
        slowdown = self.slowdown[factor or kind]
        while work > 1e-15:
            rate = 1.0 / slowdown if slowed and device and device.busy(other) else 1.0
            if flows:
                rate *= min(shared.share(key) for shared, key, _, _ in flows)
            began = self.env.now
            try:
                yield self.env.timeout(work / rate)
                work = 0.0
            except simpy.Interrupt:
                me.retiming = False  # resources.retime: the next change may interrupt again
                work -= (self.env.now - began) * rate
        if device:
            device.end(kind, me)
        for shared, key, _, _ in flows:
            shared.end(key, me)

    def check_finished(self) -> None:
        """Every task ran on every rank; otherwise name the first task that never finished."""
        for (rank, tid), event in self.done.items():
            if not event.triggered:
                raise SimulationError(f"deadlock: task #{tid} never ran on rank {rank} (a wait "
                                      f"before the task that its collective's input needs?)")
