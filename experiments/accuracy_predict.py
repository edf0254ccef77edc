"""experiments.accuracy's predictions: each model's graph (captured once), the plans it runs
(searched with the cluster's profile, or a 2-D strategy's file), which strategies lower on the
cluster, the simulator's prediction of a configuration from a profile, and where a run keeps its
profiles and plans (a re-prediction finds them by these names)."""
from __future__ import annotations

import functools
import logging
from pathlib import Path

from hidup.emulation.netns import Cluster
from hidup.models import capture_model, get_model
from hidup.planning.costs import kernel_coverage
from hidup.planning.planfile import resolve_strategy, save_plan
from hidup.planning.profile_file import load_profile
from hidup.planning.programme import SearchOptions
from hidup.planning.search import search
from hidup.program import lower
from hidup.strategy import ACROSS, fixed_strategy
from simulator.montecarlo import expected_step

log = logging.getLogger(__name__)
OPTIMIZER = "sgd"  # what every run trains with, calibration.ops times and the Program prices


def base_path(folder: Path, hosts: int, ranks_per_host: int, bandwidth: str) -> Path:
    """The cluster's profile (calibration.profile)."""
    return folder / f"profile-{hosts}x{ranks_per_host}-{bandwidth}.json"


def kernels_path(folder: Path, base: Path, model: str, tag: str = "") -> Path:
    """`base` with the model's kernels (calibration.ops)."""
    return folder / f"{base.stem}-{model.replace(':', '-')}{tag}.json"


def plan_path(folder: Path, model: str, profile: Path) -> Path:
    """The plan searched with `profile`."""
    return folder / f"plan-{model.replace(':', '-')}-{profile.stem}.json"


def mesh_plan_path(folder: Path, model: str, name: str, hosts: int, ranks_per_host: int) -> Path:
    """The plan file of 2-D strategy `name`."""
    return folder / f"plan-{model.replace(':', '-')}-{name}-{hosts}x{ranks_per_host}.json"


@functools.lru_cache(maxsize=None)
def captured(model: str, world: int):
    """The model's graph at its batch for `world` ranks (captured once per experiment)."""
    spec = get_model(model, gpus=world)
    return spec, capture_model(spec, spec.batch)


def plan_for(model: str, profile_path: Path, world: int, folder: Path) -> Path:
    """The searched plan for this cluster (hidup.planning.search with its profile): the plan
    file."""
    graph = captured(model, world)[1]
    profile = load_profile(profile_path)
    result = search(graph, world, profile, SearchOptions(k=2, optimizer=OPTIMIZER))
    path = plan_path(folder, model, profile_path)
    save_plan(path, graph, result.strategy, world, model, profile.name, optimizer=OPTIMIZER)
    return path


def mesh_plan(model: str, name: str, cluster: Cluster, folder: Path) -> str:
    """The plan file of a 2-D strategy of ACROSS on the cluster's hosts x ranks per host (a
    strategy name alone does not carry the mesh)."""
    graph = captured(model, cluster.world)[1]
    strategy = fixed_strategy(name, graph, cluster.world, cluster.hosts)
    path = mesh_plan_path(folder, model, name, cluster.hosts, cluster.ranks_per_host)
    save_plan(path, graph, strategy, cluster.world, model, optimizer=OPTIMIZER)
    return str(path)


def runnable(model: str, strategies: list[str], cluster: Cluster) -> list[str]:
    """The strategies that lower for `model` on the cluster's ranks at k = 1 and 2 (the others
    are logged with the reason and left out, e.g. a batch that does not split into 3 ranks, or
    a 2-D strategy on one rank per host)."""
    world = cluster.world
    spec, graph = captured(model, world)
    out = []
    for s in strategies:
        try:
            if s in ACROSS and cluster.ranks_per_host < 2:
                raise ValueError("a 2-D mesh needs 2 or more ranks per host")
            strategy = fixed_strategy(s, graph, world, cluster.hosts) if s in ACROSS else \
                None if s == "searched" else resolve_strategy(s, graph, world)
            if strategy is not None:
                for k in (1, 2):
                    lower(graph, strategy, world, k, spec.name)
            out.append(s)
        except ValueError as exc:
            log.warning("%s %s on %d ranks left out: %s", model, s, world, exc)
    return out


def predict(model: str, strategy: str, k: int, profile_path: Path, world: int):
    spec, graph = captured(model, world)
    program = lower(graph, resolve_strategy(strategy, graph, world), world, k, spec.name,
                    optimizer=OPTIMIZER)
    profile = load_profile(profile_path)
    return expected_step(program, profile), kernel_coverage(profile, program.tasks)
