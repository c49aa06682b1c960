"""A plan as a picture: per-rank bars beside the even plan, and the predicted speed-up.

Five panels, one bar pair per rank (the plan's bar coloured by what binds the rank, the even
plan's grey beside it): samples per step, micro-batches, state share (% of the rank's shard group's
state), memory used against the usable limit (the limit a black tick), and the predicted step
against the slowest rank's (dashed). The title gives both throughputs and the speed-up. The even
plan is the ``even`` baseline as a plan (equal batches and shares, one micro-batch count); where it
is infeasible the picture shows the plan alone and says why.

matplotlib is an optional dependency (the ``plot`` extra): :func:`require_matplotlib` names the
install line when it is missing. Nothing here is imported by the planner itself.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from cephalo_lightning._common.vocabulary import Planner
from cephalo_lightning.planner.planning import plan as make_plan
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Binding, Plan
from cephalo_lightning.planner.schema.planning_error import PlanningError

MAX_RANKS = 128  # bars beyond this are unreadable: the picture shows the first ones and says so
COLOURS = {Binding.COMPUTE: "tab:blue", Binding.MEMORY: "tab:red", Binding.LINK: "tab:orange",
           Binding.GRANULARITY: "tab:green", None: "tab:gray"}
EVEN_COLOUR = "lightgray"
INSTALL = "pip install 'cephalo-lightning[plot]'"


class MissingPlotting(PlanningError):
    """matplotlib is not installed: the picture needs the ``plot`` extra."""


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files, no display), or :class:`MissingPlotting`."""
    try:
        import matplotlib
    except ImportError:
        raise MissingPlotting(f"--plot draws with matplotlib, which is not installed; install it with {INSTALL} "
                              "(or pip install matplotlib), or leave --plot out") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def even_plan(cluster: Cluster, plan: Plan) -> tuple[Plan | None, str]:
    """The even baseline of ``plan``'s cluster and batch as a plan, or None and why it has none."""
    known = plan.baselines.get(Planner.EVEN)
    if known is not None and not known.feasible:
        return None, f"the even plan is infeasible: {known.reason}"
    try:
        return make_plan(cluster, plan.global_batch_size, mode=plan.mode, planner=Planner.EVEN), ""
    except PlanningError as err:
        return None, str(err)


def _title(plan: Plan, even: Plan | None, why_none: str) -> str:
    emulated = " (emulated)" if plan.emulated else ""
    head = (f"{plan.planner} plan{emulated}: global batch {plan.global_batch_size} on {plan.world_size} ranks, "
            f"{plan.predicted_samples_per_s or 0:.3g} samples/s predicted")
    if even is not None and even.predicted_samples_per_s and plan.predicted_samples_per_s:
        speedup = plan.predicted_samples_per_s / even.predicted_samples_per_s
        return f"{head}\neven plan {even.predicted_samples_per_s:.3g} samples/s: {speedup:.2f}x faster than even"
    return f"{head}\nno even plan to compare: {why_none}"


def plan_figure(plan: Plan, even: Plan | None = None, why_none: str = "") -> Any:
    """The figure (see the module docstring); ``even``: the even plan to draw beside it."""
    plt = require_matplotlib()
    shown = plan.ranks[:MAX_RANKS]
    evens = even.ranks[:MAX_RANKS] if even is not None else ()
    x = list(range(len(shown)))
    width = 0.4 if evens else 0.8
    mine = [i - width / 2 for i in x] if evens else x
    theirs = [i + width / 2 for i in x]
    colours = [COLOURS[r.binding] for r in shown]
    fig, axes = plt.subplots(5, 1, figsize=(max(8.0, 0.35 * len(shown) + 2), 12), sharex=True)
    panels = (
        ("samples per step", lambda r: r.batch_size),
        ("micro-batches", lambda r: r.num_micro_batches if r.batch_size else 0),
        ("state share (%)", lambda r: 100 * r.state_share),
        ("memory used (GiB)", lambda r: r.predicted_memory_gb or 0.0),
        ("predicted step (s)", lambda r: r.predicted_step_s or 0.0),
    )
    for ax, (label, value) in zip(axes, panels):
        ax.bar(mine, [value(r) for r in shown], width, color=colours)
        if evens:
            ax.bar(theirs, [value(r) for r in evens], width, color=EVEN_COLOUR)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    memory_ax, step_ax = axes[3], axes[4]
    for positions, ranks in ((mine, shown), (theirs, evens)):
        limits = [(p, r.memory_limit_gb) for p, r in zip(positions, ranks) if r.memory_limit_gb is not None]
        if limits:
            memory_ax.scatter([p for p, _ in limits], [v for _, v in limits], marker="_", s=200, color="black",
                              zorder=3)
    if plan.predicted_step_s:
        step_ax.axhline(plan.predicted_step_s, color="black", linestyle="--", linewidth=1)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLOURS[b]) for b in Binding]
    names = [f"binds: {b}" for b in Binding]
    if evens:
        handles.append(plt.Rectangle((0, 0), 1, 1, color=EVEN_COLOUR))
        names.append("even plan")
    handles += [plt.Line2D([], [], color="black", marker="_", markersize=12, linestyle="None"),
                plt.Line2D([], [], color="black", linestyle="--", linewidth=1)]
    names += ["usable memory limit", "the plan's step"]
    fig.legend(handles, names, fontsize=7, ncol=4, loc="lower center")
    step_ax.set_xticks(x, [f"{r.rank}\n{r.device}" for r in shown], fontsize=6, rotation=90 if len(x) > 16 else 0)
    step_ax.set_xlabel("rank" + (f" (the first {MAX_RANKS} of {plan.world_size})" if plan.world_size > MAX_RANKS else ""))
    fig.suptitle("\n".join(textwrap.fill(line, 100) for line in _title(plan, even, why_none).splitlines()), fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    return fig


def save_plan_figure(plan: Plan, path: str | Path, even: Plan | None = None, why_none: str = "") -> Path:
    """Draw :func:`plan_figure` into ``path`` (PNG by its suffix) and close it."""
    plt = require_matplotlib()
    fig = plan_figure(plan, even, why_none)
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return Path(path)
