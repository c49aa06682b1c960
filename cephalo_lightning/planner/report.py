"""Human-readable rendering of a plan: one table row per rank and a summary with the baselines.

Used by the ``plan`` command and, later, by the Lightning callback that logs the plan in use.
"""

from __future__ import annotations

import io

from rich import box
from rich.console import Console
from rich.table import Table

from cephalo_lightning.planner.plan import Plan, RankPlan


def _gib(value: float | None) -> str:
    """Three significant digits: a 0.02 GiB emulated device must not print as 0.0."""
    return "-" if value is None else f"{value:.3g}"


def _memory(predicted: float | None, limit: float | None, capacity: float | None) -> str:
    parts = [_gib(predicted), _gib(limit)]
    if capacity is not None:
        parts.append(_gib(capacity))
    return "/".join(parts)


def _micro(r: RankPlan) -> str:
    if not r.batch_size:
        return "-"
    sizes = sorted(set(r.micro_batch_sizes))
    kept = "" if r.recompute else " kept"  # the graph is kept: no recompute in the backward pass
    return f"{r.num_micro_batches} x " + "-".join(str(s) for s in sizes) + kept


def _row(r: RankPlan, groups: bool = False) -> tuple[str, ...]:
    step = f"{r.predicted_step_s:.4g}" if r.predicted_step_s is not None else "-"
    group = (str(r.shard_group),) if groups else ()
    return (*group, r.device, str(r.batch_size), _micro(r), f"{100 * r.state_share:.1f}%", step,
            _memory(r.predicted_memory_gb, r.memory_limit_gb, r.memory_capacity_gb), r.source)


def _span(ranks: tuple[int, ...]) -> str:
    contiguous = ranks == tuple(range(ranks[0], ranks[-1] + 1))
    if len(ranks) == 1:
        return str(ranks[0])
    return f"{ranks[0]}-{ranks[-1]}" if contiguous else ",".join(map(str, ranks))


def groups_line(plan: Plan) -> str:
    """The shard groups in one line: each group's ranks, or their sizes when there are many."""
    groups = plan.shard_groups
    if len(groups) == 1:
        return f"shard groups: one of all {plan.world_size} ranks (full shard)"
    if all(len(g) == 1 for g in groups):
        return f"shard groups: {len(groups)} of one rank each (data parallel: every rank holds the whole state)"
    if len(groups) <= 8:
        return f"shard groups: {len(groups)}, ranks " + " | ".join(_span(g) for g in groups) + \
            " (state sharded inside a group, replicated across groups)"
    sizes: dict[int, int] = {}
    for g in groups:
        sizes[len(g)] = sizes.get(len(g), 0) + 1
    shown = ", ".join(f"{count} of {size} ranks" for size, count in sorted(sizes.items()))
    return f"shard groups: {len(groups)} ({shown}; state sharded inside a group, replicated across groups)"


def _runs(plan: Plan) -> list[tuple[str, tuple[str, ...]]]:
    """Consecutive ranks with identical rows fold into one ("0-15")."""
    runs: list[tuple[int, int, tuple[str, ...]]] = []
    groups = plan.num_shard_groups > 1
    for r in plan.ranks:
        row = _row(r, groups)
        if runs and runs[-1][2] == row:
            runs[-1] = (runs[-1][0], r.rank, row)
        else:
            runs.append((r.rank, r.rank, row))
    return [(str(a) if a == b else f"{a}-{b}", row) for a, b, row in runs]


def rank_table(plan: Plan) -> Table:
    """One row per rank (identical neighbours folded): what it computes, stores, and is predicted."""
    emulated = " (emulated)" if plan.emulated else ""
    title = (f"{plan.planner} plan, {plan.mode} mode, global batch {plan.global_batch_size}, "
             f"{plan.world_size} ranks{emulated}")
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    group = (("group", True),) if plan.num_shard_groups > 1 else ()
    for header, right in (("rank", True), *group, ("device", False), ("batch", True), ("micro-\nbatches", True),
                          ("state\nshare", True), ("step s", True), ("memory GiB\nused/limit/cap", True),
                          ("source", False)):
        table.add_column(header, justify="right" if right else "left", no_wrap=True)
    for ranks, row in _runs(plan):
        table.add_row(ranks, *row)
    return table


def parameters_line(plan: Plan) -> str | None:
    """"trainable N of M parameters" where the plan records a model with frozen parameters (LoRA)."""
    total, trainable = plan.model.get("parameters"), plan.model.get("trainable_parameters")
    if not total or trainable is None or trainable == total:
        return None
    return (f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2g}%): the frozen ones "
            "are charged their stored weights only")


def summary_lines(plan: Plan) -> list[str]:
    """The shard groups, throughput, fraction of the upper bound, each baseline and the speedup over it."""
    emulated = " (emulated)" if plan.emulated else ""
    lines = [groups_line(plan)] if plan.num_shard_groups > 1 else []
    lines += [line for line in (parameters_line(plan),) if line]
    if plan.predicted_samples_per_s is not None and plan.predicted_step_s is not None:
        line = (f"predicted{emulated}: {plan.predicted_samples_per_s:.3g} samples/s "
                f"(step {plan.predicted_step_s:.3g} s)")
        if plan.fraction_of_upper_bound is not None:
            line += (f", {100 * plan.fraction_of_upper_bound:.1f}% of the upper bound "
                     f"{plan.upper_bound_samples_per_s:.3g} samples/s")
        if plan.optimality_gap is not None:
            line += f"; within {100 * plan.optimality_gap:.2f}% of optimal (over the groupings weighed)"
        lines.append(line)
    for name, base in plan.baselines.items():
        if base.skipped:
            lines.append(f"  {name}: {base.reason or 'not computed'}")
            continue
        if not base.feasible or not base.predicted_samples_per_s:
            lines.append(f"  {name}: infeasible: {base.reason or 'no plan fits'}")
            continue
        line = f"  {name}: {base.predicted_samples_per_s:.3g} samples/s"
        if plan.predicted_samples_per_s:
            line += f" (this plan is {plan.predicted_samples_per_s / base.predicted_samples_per_s:.2f}x faster)"
        lines.append(line)
    if any(not r.recompute for r in plan.ranks):
        lines.append("kept: that rank's one micro-batch keeps its autograd graph instead of recomputing")
    lines.append("figures are predictions of the planner's cost model" + (
        ", from profiles measured under CPU emulation" if plan.emulated else ""))
    return lines


def render_plan(plan: Plan, width: int = 120) -> str:
    """The table and summary as plain text (no colour codes), for logs and files."""
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(rank_table(plan))
    for line in summary_lines(plan):
        console.print(line, highlight=False, markup=False)
    return buffer.getvalue()


def print_plan(plan: Plan, console: Console | None = None) -> None:
    """Print the table and summary to the terminal (or the given console)."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # a pipe or a log file: do not squeeze the table into 80 columns
            console = Console(width=120)
    console.print(rank_table(plan))
    for line in summary_lines(plan):
        console.print(line, highlight=False, markup=False)
