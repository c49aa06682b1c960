"""Human-readable rendering of a plan: a table of the ranks, its legend, why each rank gets what
it gets, and a summary with the baselines and what to do next.

Used by the ``plan`` command and by the Lightning callback that prints the plan in use. Every line
is whole: the table is laid out for the width given and stripped of its padding; the lines after
it are never wrapped by the renderer (a terminal may fold them, no sentence is cut here).
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table

from cephalo_lightning._common.vocabulary import ProfileSource
from cephalo_lightning.planner.choice import BEST_SUBSET, NO_PIPELINE, PIPELINED
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.plan import Binding, Plan, RankPlan
from cephalo_lightning.planner.search.peers import BASELINE_GROUPINGS

LEGEND = ("legend: n x m = n micro-batches of m samples (kept: no recompute); state share = the rank's part of its "
          "shard group's training state; memory used/limit/cap = predicted peak/usable/total")
LEGEND_BINDS = "; binds = what keeps the rank from one sample more (why: below)"  # plans the planner explained
CATALOG = ("catalog: figures estimated from the GPU's datasheet, not measured; profile the cluster before trusting "
           "them (python -m cephalo_lightning profile)")
SHAPES = (NO_PIPELINE, BEST_SUBSET, PIPELINED)  # the baselines that name their shape
MAX_WHY_LINES = 8  # distinct reasons shown; the plan JSON has every rank's


def _memory_unit(plan: Plan) -> tuple[str, float]:
    """GiB, or MiB when every figure is below 1 GiB (emulated devices), and the factor from GiB."""
    figures = [v for r in plan.ranks for v in (r.predicted_memory_gb, r.memory_limit_gb, r.memory_capacity_gb)
               if v is not None]
    return ("MiB", 1024.0) if figures and max(figures) < 1 else ("GiB", 1.0)


def _memory(r: RankPlan, scale: float) -> str:
    parts = [r.predicted_memory_gb, r.memory_limit_gb] + ([r.memory_capacity_gb] if r.memory_capacity_gb else [])
    return "/".join("-" if v is None else f"{v * scale:.3g}" for v in parts)


def _micro(r: RankPlan) -> str:
    if r.idle:
        return "idle"
    if not r.batch_size:
        return "-"
    sizes = sorted(set(r.micro_batch_sizes))
    kept = "" if r.recompute else " kept"  # the graph is kept: no recompute in the backward pass
    return f"{r.num_micro_batches} x " + "-".join(str(s) for s in sizes) + kept


def _explained(plan: Plan) -> bool:
    return any(r.binding is not None for r in plan.ranks)


def _row(r: RankPlan, scale: float, groups: bool = False, binds: bool = True, stages: bool = False
         ) -> tuple[str, ...]:
    step = f"{r.predicted_step_s:.4g}" if r.predicted_step_s is not None else "-"
    group = ("-" if r.idle else str(r.shard_group),) if groups else ()
    if stages:
        group = ("-", "-", *group) if r.idle else (str(r.stage), str(r.pipeline), *group)
    if r.idle:
        step = "-"
    binding = ((r.binding if r.binding is not None else "-"),) if binds else ()
    return (*group, r.device, str(r.batch_size), _micro(r), f"{100 * r.state_share:.1f}%", step,
            _memory(r, scale), *binding, r.source)


def _span(ranks: Sequence[int]) -> str:
    ranks = tuple(ranks)
    if len(ranks) == 1:
        return str(ranks[0])
    contiguous = ranks == tuple(range(ranks[0], ranks[-1] + 1))
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


def _runs(plan: Plan, scale: float) -> list[tuple[str, tuple[str, ...]]]:
    """Consecutive ranks with identical rows fold into one ("0-15")."""
    runs: list[tuple[int, int, tuple[str, ...]]] = []
    groups, binds = plan.num_shard_groups > 1, _explained(plan)
    for r in plan.ranks:
        row = _row(r, scale, groups, binds, plan.pipelined)
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
    unit, scale = _memory_unit(plan)
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    group = (("group", True),) if plan.num_shard_groups > 1 else ()
    if plan.pipelined:
        group = (("stage", True), ("pipe-\nline", True), *group)
    binds = (("binds", False),) if _explained(plan) else ()
    for header, right in (("rank", True), *group, ("device", False), ("batch", True), ("micro-\nbatches", True),
                          ("state\nshare", True), ("step s", True), (f"memory {unit}\nused/limit/cap", True),
                          *binds, ("source", False)):
        table.add_column(header, justify="right" if right else "left", no_wrap=True)
    for ranks, row in _runs(plan, scale):
        table.add_row(ranks, *row)
    return table


def why_lines(plan: Plan) -> list[str]:
    """Why each rank gets what it gets: one line per distinct reason, with the ranks it holds for."""
    reasons: dict[tuple[Binding, str], list[int]] = {}
    for r in plan.ranks:
        if r.binding is not None and r.why:
            reasons.setdefault((r.binding, r.why), []).append(r.rank)
    if not reasons:
        return []
    lines = ["why:"]
    for (binding, why), ranks in list(reasons.items())[:MAX_WHY_LINES]:
        lines.append(f"  rank{'s' if len(ranks) > 1 else ''} {_span(ranks)}: {binding}: {why}")
    if len(reasons) > MAX_WHY_LINES:
        lines.append(f"  ... {len(reasons) - MAX_WHY_LINES} more reasons: --json gives every rank's binding and why")
    return lines


def stage_lines(plan: Plan) -> list[str]:
    """A pipelined plan's stages and pipelines, and the ranks a plan leaves idle, one line each."""
    lines = []
    if plan.pipelined:
        spans, first = [], 0
        for count in plan.stage_layers:
            spans.append(f"{first}-{first + count - 1}")
            first += count
        chains = plan.pipelines
        M = plan.ranks[chains[0][0]].num_micro_batches
        S = plan.num_stages
        lines.append(f"pipelined: {S} stages (layers {' | '.join(spans)}) x {len(chains)} pipeline(s) (ranks "
                     f"{' | '.join(','.join(map(str, c)) for c in chains)}), {plan.pipeline_schedule}, {M} micro-batches "
                     f"a pipeline; the fill and drain take {100 * (S - 1) / (M + S - 1):.0f}% of the step")
    if plan.idle_ranks:
        names = sorted({plan.ranks[r].device for r in plan.idle_ranks})
        cost = plan.ranks[plan.idle_ranks[0]].why
        lines.append(f"idle: rank{'s' if len(plan.idle_ranks) > 1 else ''} {_span(plan.idle_ranks)} "
                     f"({', '.join(names)}) compute and store nothing" + (f"; {cost}" if cost else ""))
    return lines


def baseline_lines(plan: Plan) -> list[str]:
    """Each baseline with its shard grouping; baselines that predict the same throughput, listed once."""
    if not plan.baselines:
        return []
    lines = ["baselines (the same cost model; other splits of the batch and the state):"]
    same: dict[float, list[str]] = {}
    others = []
    for name, base in plan.baselines.items():
        named = f"{name} ({BASELINE_GROUPINGS[name]})" if name in BASELINE_GROUPINGS else name
        if name in SHAPES and base.feasible and base.reason:
            named = f"{name} ({base.reason})"
        if base.skipped:
            others.append(f"  {named}: {base.reason or 'not computed'}")
        elif not base.feasible or not base.predicted_samples_per_s:
            others.append(f"  {named}: infeasible: {base.reason or 'no plan fits'}")
        else:
            same.setdefault(base.predicted_samples_per_s, []).append(named)
    for rate, names in sorted(same.items(), key=lambda item: -item[0]):
        line = f"  {', '.join(names)}: {rate:.3g} samples/s"
        if plan.predicted_samples_per_s and abs(rate / plan.predicted_samples_per_s - 1) < 1e-9:
            line += "; this plan"
        elif plan.predicted_samples_per_s:
            line += f"; this plan is {plan.predicted_samples_per_s / rate:.2f}x faster"
        lines.append(line)
    return lines + others


def next_line(plan: Plan, cluster: Cluster | None = None, output: str | None = None) -> str:
    """What to do with the plan: write it (``-o``), then train with it on the cluster's layout."""
    if plan.idle_ranks:
        busy = len(plan.active_ranks)
        return (f"next: the plan leaves rank{'s' if len(plan.idle_ranks) > 1 else ''} {_span(plan.idle_ranks)} idle: "
                f"train on the {busy} busy ranks alone, with a cluster file of their devices and nodes "
                f"(plan it again), or plan with --no-subsets to use every GPU")
    path = output or "plan.json"
    first = "" if output else f"write the plan with -o {path}, then "
    if cluster is None:
        layout = f"devices= and num_nodes= for its {plan.world_size} ranks"
    else:
        per_node = list(Counter(cluster.nodes).values())
        layout = (f"devices={per_node[0]}, num_nodes={len(per_node)}" if len(set(per_node)) == 1 else
                  f"num_nodes={len(per_node)} with {'/'.join(map(str, per_node))} devices (uneven nodes)")
    if plan.pipelined:
        return (f"next: {first}train with Trainer(strategy=CephaloStrategy(plan=\"{path}\"), {layout}) "
                f"and a DataLoader of batch_size={plan.global_batch_size}, the global batch, "
                f"which the plan splits between its {len(plan.pipelines)} pipeline{'s' if len(plan.pipelines) > 1 else ''}; "
                "a pipelined plan runs in the layered mode, without CephaloCallback or Fabric yet: plan "
                "with --no-pipelines for those")
    return (f"next: {first}train with Trainer(strategy=CephaloStrategy(plan=\"{path}\"), {layout}) and a DataLoader "
            f"of batch_size={plan.global_batch_size}, the global batch, which the plan splits between the ranks")


def parameters_line(plan: Plan) -> str | None:
    """"trainable N of M parameters" where the plan records a model with frozen parameters (LoRA), with
    what each kind is charged where the plan records it: a trainable parameter its master, gradient and
    optimizer state, a frozen one what its storage holds."""
    model = plan.model
    total, trainable = model.parameters, model.trainable_parameters
    if not total or trainable is None or trainable == total:
        return None
    line = f"trainable {trainable:,} of {total:,} parameters ({100 * trainable / total:.2g}%): "
    if model.state_bytes_per_param is None or model.weight_bytes_per_param is None:
        return line + "the frozen ones are charged their stored weights only"
    return line + (f"{model.state_bytes_per_param:g} bytes each (master, gradient, optimizer state), the "
                   f"{total - trainable:,} frozen {model.weight_bytes_per_param:g} bytes each (their stored weights)")


def summary_lines(plan: Plan, cluster: Cluster | None = None, output: str | None = None,
                  next_step: bool = False, assumptions: Sequence[str] = ()) -> list[str]:
    """The legend, why each rank binds, the shard groups, the throughput against the upper bound and
    the optimum, each baseline, where the figures come from (the ``assumptions`` nothing measured,
    :func:`cephalo_lightning.planner.assumptions.assumption_lines`) and (``next_step``) what to do next."""
    emulated = " (emulated)" if plan.emulated else ""
    lines = [LEGEND + (LEGEND_BINDS if _explained(plan) else ""), *why_lines(plan)]
    lines += stage_lines(plan)
    if plan.num_shard_groups > 1:
        lines.append(groups_line(plan))
    lines += [line for line in (parameters_line(plan),) if line]
    if plan.predicted_samples_per_s is not None and plan.predicted_step_s is not None:
        line = (f"predicted{emulated}: {plan.predicted_samples_per_s:.3g} samples/s "
                f"(step {plan.predicted_step_s:.3g} s)")
        if plan.fraction_of_upper_bound is not None:
            line += (f", {100 * plan.fraction_of_upper_bound:.1f}% of the upper bound "
                     f"{plan.upper_bound_samples_per_s:.3g} samples/s (every GPU computing alone, no collectives)")
        lines.append(line)
        if plan.optimality_gap is not None:
            over = f" of ranks {_span([r.rank for r in plan.active_ranks])}" if plan.idle_ranks else ""
            lines.append(f"within {100 * plan.optimality_gap:.2f}% of optimal (certified, over the shard groupings"
                         f"{over} weighed)")
        elif plan.pipelined:
            lines.append("no certified gap: the best of the pipelined layouts, cuts and micro-batch counts weighed "
                         "(docs/pipelining.md says which)")
    lines += baseline_lines(plan)
    if any(not r.recompute for r in plan.ranks):
        lines.append("kept: that rank's one micro-batch keeps its autograd graph instead of recomputing")
    if any(r.source == ProfileSource.CATALOG for r in plan.ranks):
        lines.append(CATALOG)
    lines += assumptions
    lines.append("figures are predictions of the planner's cost model" + (
        ", from profiles measured under CPU emulation" if plan.emulated else ""))
    if next_step:
        lines.append(next_line(plan, cluster, output))
    return lines


def render_plan(plan: Plan, width: int = 120, cluster: Cluster | None = None, output: str | None = None,
                next_step: bool = False, assumptions: Sequence[str] = ()) -> str:
    """The table and the lines after it as plain text (no colour codes, no trailing spaces), for
    terminals, logs and files; the table fits ``width``, the lines are whole."""
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(rank_table(plan))
    table = [line.rstrip() for line in buffer.getvalue().splitlines()]
    return "\n".join([*table, *summary_lines(plan, cluster, output, next_step, assumptions)]) + "\n"


def print_plan(plan: Plan, cluster: Cluster | None = None, output: str | None = None, next_step: bool = True,
               assumptions: Sequence[str] = ()) -> None:
    """Print :func:`render_plan` at the terminal's width (120 columns for a pipe or a log file)."""
    console = Console()
    width = console.width if console.is_terminal else 120
    print(render_plan(plan, width, cluster, output, next_step, assumptions), end="")
