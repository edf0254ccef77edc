"""The paper's figures drawn (experiments.paper): each Figure's table written as FIGURE.csv, shown
as Markdown on stdout and drawn as FIGURE.png with matplotlib."""
from __future__ import annotations

import csv
import textwrap
from pathlib import Path

from experiments import outputs
from experiments.paper_figures import Figure, cell


# -- output --------------------------------------------------------------------------------------

def write(fig: Figure, out: Path) -> None:
    """FIGURE.csv, FIGURE.png, and the table on stdout (Markdown)."""
    with open(out / f"{fig.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fig.columns)
        writer.writeheader()
        for row in fig.rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    PLOTS[fig.name](fig, out / f"{fig.name}.png")
    print(f"\n## {fig.title}\n")
    print(table(fig))
    print(f"\nwrote {out / fig.name}.csv and {out / fig.name}.png")


def table(fig: Figure) -> str:
    """The figure's table in Markdown (a tenth of convergence's rows; search time as layers x
    GPUs), then its notes."""
    lines = _search_time_rows(fig) if fig.name == "search-time" else _rows(fig)
    return "\n".join(lines + [f"\n{note}" for note in fig.notes])


def _rows(fig: Figure) -> list[str]:
    """A row per row of the figure, a column per column."""
    shown = fig.rows if fig.name != "convergence" else fig.rows[:: max(1, len(fig.rows) // 10)]
    lines = ["| " + " | ".join(fig.columns) + " |", "|" + " --- |" * len(fig.columns)]
    return lines + ["| " + " | ".join(cell(row[c]) for c in fig.columns) + " |" for row in shown]


def _search_time_rows(fig: Figure) -> list[str]:
    """Search seconds, a row per layer count and a column per GPU count (with its mesh)."""
    gpus = list(dict.fromkeys((r["gpus"], r["mesh"]) for r in fig.rows))
    seconds = {(r["layers"], r["gpus"]): r["seconds"] for r in fig.rows}
    lines = ["| layers | " + " | ".join(f"{g} GPUs ({mesh})" for g, mesh in gpus) + " |",
             "|" + " --- |" * (len(gpus) + 1)]
    return lines + [f"| {layers} | " + " | ".join(
        f"{seconds[layers, g]:.2f} s" if (layers, g) in seconds else "" for g, _ in gpus) + " |"
        for layers in dict.fromkeys(r["layers"] for r in fig.rows)]


def _per_model(fig: Figure, path: Path, x: str, systems_: list[str], xlabel: str,
               logx: bool = False) -> None:
    """One panel per model: each system's step time against `x`."""
    plt = outputs.pyplot()
    models = list(dict.fromkeys(r["model"] for r in fig.rows))
    panels, axes = plt.subplots(1, len(models), figsize=(3.6 * len(models), 3.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in fig.rows if r["model"] == model]
        for system in systems_:
            ax.plot([r[x] for r in mine], [r[f"{system}_ms"] for r in mine], marker="o",
                    label="HiDup (searched, Duplex)" if system == "hidup" else system)
        ax.set(title=model, xlabel=xlabel, ylabel="step time (ms)")
        if logx:
            log_ticks(ax, [r[x] for r in mine])
        ax.title.set_fontsize(9)
    axes[0][0].legend(fontsize=7)
    panels.suptitle(textwrap.fill(fig.title, 110), fontsize=9)
    save_png(panels, path)


def save_png(figure, path: Path) -> None:
    """Lay a matplotlib figure out, write it as a PNG and free it."""
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def log_ticks(ax, values) -> None:
    """A log x axis labelled at the swept values only."""
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(sorted(set(values)), [f"{v:g}" for v in sorted(set(values))])


def _plot_breakdown(fig: Figure, path: Path) -> None:
    plt = outputs.pyplot()
    panels, ax = plt.subplots(figsize=(8, 3.6))
    labels = [f"{r['cluster'].replace(' machine', chr(10) + 'machine').replace(' Gbit', chr(10) + 'Gbit')}"
              f"\n{r['system']}" for r in fig.rows]
    x = range(len(fig.rows))
    comp = [r["computation_s"] for r in fig.rows]
    comm = [r["communication_s"] for r in fig.rows]
    ax.bar(x, comp, label="computation")
    ax.bar(x, comm, bottom=comp, label="communication")
    ax.scatter(x, [r["wall_s"] for r in fig.rows], color="k", marker="_", s=400, zorder=3,
               label="wall (step) time")
    ax.set_xticks(list(x), labels, fontsize=6)
    ax.set(ylabel="seconds", title=textwrap.fill(fig.title, 75))
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    save_png(panels, path)


def _plot_robustness(fig: Figure, path: Path) -> None:
    plt = outputs.pyplot()
    panels, ax = plt.subplots(figsize=(6, 3.2))
    x = range(len(fig.rows))
    ax.bar(x, [r["mean_relative_time"] - 1 for r in fig.rows], bottom=1, label="mean")
    ax.scatter(x, [r["max_relative_time"] for r in fig.rows], color="k", marker="_", s=300,
               label="worst draw", zorder=3)
    ax.axhline(1.0, color="k", lw=0.6)
    ax.set_xticks(list(x), [r["error"] for r in fig.rows], fontsize=7, rotation=20)
    ax.set(ylabel="step time / right profile's plan", title=textwrap.fill(fig.title, 75))
    ax.title.set_fontsize(8)
    ax.legend(fontsize=7)
    save_png(panels, path)


def _plot_search_time(fig: Figure, path: Path) -> None:
    plt = outputs.pyplot()
    panels, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
    for gpus in sorted({r["gpus"] for r in fig.rows}):
        mine = [r for r in fig.rows if r["gpus"] == gpus]
        a.plot([r["layers"] for r in mine], [r["seconds"] for r in mine], marker="o",
               label=f"{gpus} GPUs")
    for layers in sorted({r["layers"] for r in fig.rows}):
        mine = [r for r in fig.rows if r["layers"] == layers]
        b.plot([r["gpus"] for r in mine], [r["seconds"] for r in mine], marker="o",
               label=f"{layers} layers")
    a.set(xlabel="layers", ylabel="search time (s)")
    b.set(xlabel="GPUs", ylabel="search time (s)")
    log_ticks(b, [r["gpus"] for r in fig.rows])
    a.legend(fontsize=7)
    b.legend(fontsize=7)
    panels.suptitle(textwrap.fill(fig.title, 110), fontsize=9)
    save_png(panels, path)


def _plot_convergence(fig: Figure, path: Path) -> None:
    plt = outputs.pyplot()
    panels, ax = plt.subplots(figsize=(6, 3.4))
    steps = [r["step"] for r in fig.rows]
    ax.plot(steps, [r["ddp_loss"] for r in fig.rows], lw=2.5, alpha=0.5, label="ddp")
    ax.plot(steps, [r["hidup_loss"] for r in fig.rows], lw=1, label="HiDup (searched, Duplex)")
    ax.set(xlabel="step", ylabel="training loss", title=textwrap.fill(fig.title, 75))
    ax.title.set_fontsize(7)
    ax.legend(fontsize=7)
    save_png(panels, path)


PLOTS = {
    "scaling": lambda f, p: _per_model(f, p, "gpus", ["hidup", "expert", "best_1d", "best_2d"],
                                       "GPUs", logx=True),
    "one-machine": lambda f, p: _per_model(f, p, "gpus", ["hidup", "expert", "ddp"], "GPUs"),
    "bandwidth": lambda f, p: _per_model(f, p, "gbit", ["hidup", "expert", "ddp"],
                                         "inter-machine link (Gbit/s)", logx=True),
    "batch": lambda f, p: _per_model(f, p, "per_gpu_batch", ["hidup", "expert", "ddp"],
                                     "batch per GPU", logx=True),
    "breakdown": _plot_breakdown, "robustness": _plot_robustness,
    "search-time": _plot_search_time, "convergence": _plot_convergence}
