"""experiments.accuracy --combine: earlier runs' folders read back as one table, each
configuration optionally predicted again (--repredict) by this version's simulator from the
profile and plan its run kept."""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from experiments.accuracy_predict import (
    base_path,
    kernels_path,
    mesh_plan_path,
    plan_path,
    predict,
)
from experiments.accuracy_rows import Row, read_rows
from hidup.strategy import ACROSS

log = logging.getLogger(__name__)


def saved_inputs(folder: Path, row: Row) -> tuple[Path, str]:
    """The profile that a calibrated-once run in `folder` predicted `row` from and the strategy
    argument it ran (the searched or 2-D plan's file), as model_profile named them."""
    base = base_path(folder, row.hosts, row.ranks_per_host, row.bandwidth)
    kernels = kernels_path(folder, base, row.model)
    searched = kernels_path(folder, kernels, row.model, "-searched")
    profile = searched if searched.is_file() else kernels
    arg = str(plan_path(folder, row.model, kernels)) if row.strategy == "searched" else \
        str(mesh_plan_path(folder, row.model, row.strategy, row.hosts, row.ranks_per_host)) \
        if row.strategy in ACROSS else row.strategy
    for path in (profile, Path(arg) if arg != row.strategy else None):
        if path is not None and not path.is_file():
            raise ValueError(f"--repredict {folder}: {row.model} {row.strategy} on "
                             f"{row.cluster} was predicted from {path}, which is not there; "
                             f"re-predict only folders a run wrote, with their profiles and "
                             f"plans")
    return profile, arg


def repredicted(row: Row, folder: Path) -> Row:
    """`row` predicted again by this version's simulator from the profile and plan its run saved
    (the measured times stay as they were)."""
    profile, arg = saved_inputs(folder, row)
    result, coverage = predict(row.model, arg, row.k, profile, row.hosts * row.ranks_per_host)
    return replace(row, predicted_ms=result.step_time * 1e3,
                   predicted_computation_ms=result.computation * 1e3,
                   predicted_communication_ms=result.communication * 1e3,
                   predicted_overlap=result.overlap_ratio, kernels_measured=coverage)


def combine(folders: list[Path], repredict: bool = False) -> tuple[list[Row], list[dict]]:
    """Every configuration of the runs in `folders`, and each run's folder and command; a
    configuration measured in two of them is refused (it would count twice). With `repredict`,
    each is predicted again by this version's simulator (repredicted)."""
    rows: list[Row] = []
    seen: dict[tuple, Path] = {}
    sources = []
    for folder in folders:
        ran = _command(folder)
        if repredict and ran and "--recalibrate-each" in ran:
            raise ValueError(f"--repredict {folder}: that run timed each configuration's "
                             f"kernels right before it ran (--recalibrate-each), and those "
                             f"profiles were not kept; re-predict runs calibrated once")
        for r in read_rows(folder):
            if repredict:
                r = repredicted(r, folder)
                log.info("%s %s k=%d on %s: re-predicted %.1f ms, measured %.1f ms, error "
                         "%+.1f%%", r.model, r.strategy, r.k, r.cluster, r.predicted_ms,
                         r.measured_ms, 100 * r.error)
            key = (r.model, r.strategy, r.k, r.cluster)
            if key in seen:
                raise ValueError(f"--combine: {r.model} {r.strategy} k={r.k} on {r.cluster} is "
                                 f"in both {seen[key]} and {folder}; combine runs of different "
                                 f"configurations")
            seen[key] = folder
            rows.append(r)
        sources.append({"folder": str(folder), "command": ran,
                        **({"repredicted": True} if repredict else {})})
    if not rows:
        raise ValueError(f"--combine: no configurations in {', '.join(map(str, folders))}")
    return rows, sources


def _command(folder: Path) -> str | None:
    """The command of the run that wrote `folder` (its accuracy.json), if it says."""
    summary = folder / "accuracy.json"
    try:
        return json.loads(summary.read_text()).get("command") if summary.is_file() else None
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise ValueError(f"--combine {folder}: {summary} is not the summary an "
                         f"experiments.accuracy run writes ({exc}); restore or delete "
                         f"it") from None
