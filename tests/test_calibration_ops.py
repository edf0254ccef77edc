"""calibration.ops: every kernel of a Program is measured in the training step as hidup.train
runs it (the optimizer's step outside the graph is the update's time), with collectives stood
in locally or run for real (in situ: a rank's wait for its peers is not counted), the profile carries them,
and the simulator and the planner's estimate price kernels, packing and unpacking of
collectives with them alike; kernels timed in situ are not slowed again by interference."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace

import pytest
import torch

import calibration.ops
from calibration.ops import (main as ops_main, measure_in_turns, measure_kernels, quantiles,
                             without_stalls)
from hidup.models import capture_model, get_model
from hidup.planning.costs import kernel_coverage, kernel_key
from hidup.planning.estimate import estimate
from hidup.planning.planfile import resolve_strategy
from hidup.planning.profile_file import from_dict, load_profile
from hidup.program import Compute, Convert, lower
from hidup.runtime.passes import TaskClock
from simulator import simulate

from conftest import run_ranks


def program(model: str, strategy: str, world: int, k: int):
    spec = get_model(model, gpus=world)
    graph = capture_model(spec, spec.batch)
    return lower(graph, resolve_strategy(strategy, graph, world), world, k, spec.name,
                 optimizer="sgd")


def _measure_with_stand_ins(rank, world, strategy):
    return measure_kernels("gpt:tiny", strategy, world, 2, steps=2, warmup=1,
                           optimizer="sgd")


@pytest.mark.parametrize("strategy", ["ddp", "megatron"])
def test_every_kernel_and_collective_of_the_program_is_measured(strategy):
    times = run_ranks(2, _measure_with_stand_ins, strategy)[0]
    prog = program("gpt:tiny", strategy, 2, 2)
    kernels = {key: min(v) for key, v in times.items()}
    profile = replace(load_profile("cpu-gloo-loopback"), kernels=kernels)
    assert kernel_coverage(profile, prog.tasks) == 1.0
    for task in prog.tasks:
        if isinstance(task, Compute):
            assert profile.compute_time(task) == kernels[kernel_key(task)]
        if isinstance(task, Convert) and task.collective:  # measured; a lone all-reduce has no
            # packing or unpacking (it reduces the gradient itself), the others and buckets do
            assert f"issue {kernel_key(task)}" in kernels, task
            pack, unpack = profile.host_times(task)
            if task.kind != "all_reduce" or len(task.inputs) > 1:
                assert pack > 0 and unpack > 0, (task, pack, unpack)


class _SlowSGD(torch.optim.SGD):
    """SGD whose step takes 20 ms more: what the Trainer spends outside the graph."""

    def step(self, closure=None):
        time.sleep(0.02)
        return super().step(closure)


def test_the_update_is_the_optimizer_step_as_the_trainer_runs_it(monkeypatch):
    """One rank times hidup.train's step: the graph task by task, and what the step spends
    outside it (the torch.optim step, the Trainer's bookkeeping) as the update task."""
    monkeypatch.setattr("hidup.train.optimizer_factory",
                        lambda name, lr: lambda params: _SlowSGD(params, lr=lr))
    times = measure_kernels("mlp:tiny", "ddp", 1, 2, steps=3, warmup=1, optimizer="sgd")
    prog = program("mlp:tiny", "ddp", 1, 2)
    [update] = [t for t in prog.tasks if isinstance(t, Compute) and t.phase == "update"]
    assert all(0.02 <= t < 0.2 for t in times[kernel_key(update)])  # the sleep is in it
    others = [sum(v) / 3 for key, v in times.items() if key != kernel_key(update)]
    assert 0 < sum(others) < 0.02  # and in no other kernel


def local_tasks(prog) -> list:
    """The tasks a compute stream runs as kernels: Computes and local conversions."""
    return [t for t in prog.tasks if isinstance(t, Compute)
            or (isinstance(t, Convert) and not t.collective)]


def inner_reductions(prog, profile) -> float:
    """Seconds of the collectives kernels run inside themselves (Compute.inner: megatron's
    vocabulary-parallel loss), which hold the compute stream beside the kernels' own time."""
    return sum(profile.collective_time(kind, b, prog.group(0))
               for t in prog.tasks if isinstance(t, Compute) for kind, b in t.inner)


def test_measured_kernels_change_the_prediction_and_estimate_still_equals_the_simulator():
    prog = program("gpt:tiny", "megatron", 2, 2)
    base = replace(load_profile("cpu-gloo-loopback"), interference_compute=1.0,
                   interference_comm=1.0)
    # a kernel table that makes every kernel 1 ms and every packing / unpacking 0.5 ms
    kernels = {kernel_key(task): 1e-3 for task in local_tasks(prog)}
    for task in prog.collectives:
        kernels[f"issue {kernel_key(task)}"] = kernels[f"finish {kernel_key(task)}"] = 5e-4
    measured = replace(base, kernels=kernels)
    plain, timed = simulate(prog, base), simulate(prog, measured)
    assert timed.step_time != pytest.approx(plain.step_time)
    n_kernels = len(local_tasks(prog))
    n_coll = len(prog.collectives)
    # the compute stream is busy for every kernel, packing and unpacking: exactly that much
    assert timed.computation == pytest.approx(n_kernels * 1e-3 + n_coll * 2 * 5e-4
                                              + inner_reductions(prog, base))
    assert estimate(prog, measured).step_time == pytest.approx(timed.step_time, rel=1e-12)
    assert estimate(prog, measured).computation == pytest.approx(timed.computation)


class _LateClock(TaskClock):
    """Rank 1's clock: it starts each step's first task 50 ms late, before its clock reads (the
    Timer sets `first` to None as a step starts); `late` counts the steps it held back."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank, self.late = rank, 0

    def enter(self, task, standin):
        if self.rank == 1 and self.first is None:
            time.sleep(0.05)
            self.late += 1
        return super().enter(task, standin)


def _measure_in_situ_with_a_late_peer(rank, world):
    clocks = []
    calibration.ops.TaskClock = lambda: clocks.append(_LateClock(rank)) or clocks[-1]
    times = measure_kernels("gpt:tiny", "megatron", world, 1, steps=2, warmup=1, real=True,
                            optimizer="sgd")
    return times, clocks[0].late


def test_in_situ_kernels_run_real_collectives_and_leave_out_the_wait_for_peers():
    (times, _), (_, late) = run_ranks(2, _measure_in_situ_with_a_late_peer)
    assert late == 3  # rank 1 held back every step: the warm-up and the two timed
    prog = program("gpt:tiny", "megatron", 2, 1)
    profile = replace(load_profile("cpu-gloo-loopback"),
                      kernels={key: max(v) for key, v in times.items()})
    assert kernel_coverage(profile, prog.tasks) == 1.0
    # rank 0 waits about 50 ms for rank 1 at its first collective of each step; counted as
    # that collective's issuing or unpacking ('issue KEY', 'finish KEY'), one would take over
    # 50 ms
    ends = {key: max(v) for key, v in times.items() if key.startswith(("issue", "finish"))}
    assert ends and max(ends.values()) < 0.025, ends
    # the call that hands each collective to the network is timed, and is part of its issuing
    for task in prog.collectives:
        calls, issues = times[f"call {kernel_key(task)}"], times[f"issue {kernel_key(task)}"]
        assert len(calls) == len(issues) and all(0 < c <= i for c, i in zip(calls, issues))


def test_a_step_s_breakdown_is_its_kernels_and_what_the_rank_waited():
    class Timer:  # three kept steps of 30, 50 and 40 ms
        walls = [0.030, 0.050, 0.040]

    # every occurrence of each kernel over the three steps: 60 ms of kernels in all
    times = {"fwd a": [0.005, 0.005, 0.005], "bwd a": [0.01, 0.01, 0.01], "update": [0.005] * 3}
    step, kernels = calibration.ops.breakdown(Timer(), times)
    assert step == pytest.approx(0.040)  # the median step
    assert kernels == pytest.approx(0.020)  # per step: the rest, 20 ms, the rank waited


def test_a_collective_s_measured_call_is_charged_to_its_issuing_stream_not_twice():
    """A collective's call (timed in real steps, 'call KEY') is part of its issuing on the
    compute stream and is taken off its time on the network, which calibration.profile measured
    with the call in it: with Duplex the call no longer hides under the other micro-batch's
    compute; the planner's estimate agrees with the simulator."""
    prog = program("gpt:tiny", "megatron", 2, 2)
    base = replace(load_profile("cpu-gloo-loopback"), interference_compute=1.0,
                   interference_comm=1.0)
    kernels = {kernel_key(task): 1e-3 for task in local_tasks(prog)}
    for task in prog.collectives:
        kernels[f"issue {kernel_key(task)}"] = 2e-3  # of which the call is 1.5 ms
        kernels[f"finish {kernel_key(task)}"] = 5e-4
    without = replace(base, kernels=kernels)
    kernels = dict(kernels, **{f"call {kernel_key(t)}": 1.5e-3 for t in prog.collectives})
    called = replace(base, kernels=kernels)
    plain, timed = simulate(prog, without), simulate(prog, called)
    assert timed.computation == pytest.approx(plain.computation)  # issuing is 2 ms either way
    network = sum(base.collective_time(t.kind, t.bytes, t.group) for t in prog.collectives)
    shorter = sum(min(1.5e-3, base.collective_time(t.kind, t.bytes, t.group))
                  for t in prog.collectives)
    assert plain.communication == pytest.approx(network)
    assert timed.communication == pytest.approx(network - shorter)
    for task in prog.collectives:  # the call comes off the latency first, never below zero
        latency, transfer = called.network_split(task, task.group)
        full = base.collective_split(task.kind, task.bytes, task.group)
        assert latency >= 0 and transfer >= 0
        assert latency + transfer == pytest.approx(max(0.0, sum(full) - 1.5e-3))
    assert estimate(prog, called).step_time == pytest.approx(timed.step_time, rel=1e-12)


def test_kernels_timed_in_situ_are_not_slowed_again_by_interference():
    prog = program("gpt:tiny", "megatron", 2, 2)  # Duplex: kernels run beside collectives
    base = replace(load_profile("cpu-gloo-loopback"), interference_compute=2.0,
                   interference_comm=1.0)
    kernels = {kernel_key(task): 1e-3 for task in local_tasks(prog)}
    apart = simulate(prog, replace(base, kernels=kernels))
    in_situ = simulate(prog, replace(base, kernels=kernels, kernels_in_situ=True))
    assert in_situ.computation == pytest.approx(len(local_tasks(prog)) * 1e-3
                                                + inner_reductions(prog, base))
    assert apart.computation > in_situ.computation + 3e-3  # slowed while collectives run
    assert in_situ.step_time < apart.step_time


def test_profile_round_trips_its_kernels_and_refuses_bad_ones():
    doc = load_profile("cpu-gloo-loopback").to_dict()
    doc["kernels"] = {"fwd aten.mm.default [2, 2],[2, 2]->[2, 2]": 1e-5}
    assert from_dict(json.loads(json.dumps(doc))).kernels == doc["kernels"]
    doc["kernels_in_situ"] = True
    assert from_dict(json.loads(json.dumps(doc))).kernels_in_situ
    assert "kernels_in_situ" not in load_profile("cpu-gloo-loopback").to_dict()  # false: left out
    doc["kernels_in_situ"] = "yes"
    with pytest.raises(ValueError, match="kernels_in_situ"):
        from_dict(doc)
    del doc["kernels_in_situ"]
    doc["kernels"] = {"fwd x": -1}
    with pytest.raises(ValueError, match="kernels"):
        from_dict(doc)
    doc["kernels"] = [1, 2]
    with pytest.raises(ValueError, match="must map kernel keys to seconds"):
        from_dict(doc)


def test_command_line_writes_a_profile_with_the_kernels(tmp_path, capsys, caplog):
    out = tmp_path / "p.json"
    with caplog.at_level(logging.INFO, logger="calibration.ops"):
        assert ops_main(["--model", "mlp:tiny", "--strategy", "ddp", "--micro-batches", "1",
                         "--steps", "1", "--warmup", "0", "--optimizer", "sgd",
                         "--base", "cpu-gloo-loopback",
                         "--out", str(out)]) == 0
    assert "ddp k=1: step" in caplog.text and "its kernels" in caplog.text  # the breakdown
    profile = load_profile(out)
    assert kernel_coverage(profile, program("mlp:tiny", "ddp", 1, 1).tasks) == 1.0
    assert "Kernels of mlp:tiny measured" in profile.source
    assert ops_main(["--model", "mlp:tiny", "--base", "no-such-profile", "--out",
                     str(out)]) == 2
    assert "unknown cluster profile" in capsys.readouterr().err


def test_spread_keeps_the_mean_of_rare_slow_runs():
    runs = [1.0] * 49 + [51.0]  # one stall in fifty runs: mean 2.0
    spread = quantiles(runs)
    assert len(spread) == 16 and spread == sorted(spread)
    assert sum(spread) / len(spread) == pytest.approx(2.0, rel=0.05)  # a draw keeps the mean
    assert spread[0] == 1.0 and spread[-1] > 10.0  # the stall is in the top value
    assert quantiles([3.0, 1.0, 2.0]) == [1.0, 2.0, 3.0]  # fewer runs than values: each run


def test_a_stall_is_left_out_and_named(tmp_path, caplog, monkeypatch):
    """A run 50x its kernel's median and a second over it is a stall: left out of the kernel's
    mean and spread, with a warning that names the kernel; jitter of microseconds stays."""
    kept, stalls = without_stalls([1e-3] * 9 + [0.15])
    assert kept == [1e-3] * 9 and stalls == [0.15]
    tiny = [2e-6] * 9 + [4e-5]  # 20x the median but 38 us over it: jitter, kept
    assert without_stalls(tiny) == (tiny, [])
    assert without_stalls([1e-3] * 9 + [1.9e-3]) == ([1e-3] * 9 + [1.9e-3], [])
    real = calibration.ops.KernelTimer.times

    def stalled(self):
        times = real(self)
        key = max(times, key=lambda k: sum(times[k]))
        times[key] = times[key][:-1] + [times[key][-1] + 0.5]  # the machine stops 0.5 s
        return times
    monkeypatch.setattr(calibration.ops.KernelTimer, "times", stalled)
    out = tmp_path / "p.json"
    with caplog.at_level(logging.INFO, logger="calibration.ops"):
        assert ops_main(["--model", "mlp:tiny", "--strategy", "ddp", "--micro-batches", "1",
                         "--steps", "3", "--warmup", "1", "--optimizer", "sgd",
                         "--base", "cpu-gloo-loopback", "--out", str(out)]) == 0
    assert "runs left out as stalls" in caplog.text
    profile = load_profile(out)
    assert max(profile.kernels.values()) < 0.1  # the stall moved no kernel's mean
    assert max(max(q) for q in profile.kernel_quantiles.values()) < 0.1


class _Logged:
    """A stand-in KernelTimer that logs its calls."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def step(self):
        self.log.append(f"{self.name} step")

    def start(self):
        self.log.append(f"{self.name} start")


def test_configurations_are_timed_in_turns_after_each_warms_up():
    log: list[str] = []
    measure_in_turns([_Logged("a", log), _Logged("b", log)], steps=2, warmup=1)
    assert log == ["a step", "a start", "b step", "b start",  # warm-up, then keep from here
                   "a step", "b step", "a step", "b step"]  # one step of each per round
