"""A lower bound on a pipelined candidate's step before it is priced, and which candidates cannot fit.

For a layout's pipeline d (stage s on rank r_ds, micro-batch m_d = ceil(B_d / M)), every cut
l_0 + ... + l_{S-1} = L gives the slowest stage at least::

    g_ds = 2 F_ds + B_ds          (F, B one layer's forward and backward at m_d; the forward recomputed)
    max_s t_s >= max_s (l_s g_ds + c_ds) >= L / sum_s (1 / g_ds) + min_s c_ds      (c: a micro-batch's overhead)
    step >= contention * (M + S - 1) * max_d (L / sum_s (1 / g_ds) + min_s c_ds) + step_overhead

[Note: why the step bound is valid] :mod:`.pipeline_cost` prices rank i's micro-step as
``u = comb(., l F) + comb(., l (F + B) + c)`` with ``comb(x, y) = max(x, y) + (1 - overlap)
min(x, y) >= y`` for x, y >= 0 and overlap <= 1 (the gathers and reductions are never negative), so
``u >= l (2 F + B) + c``: the compute alone, no communication. If every
stage of pipeline d took less than T, then l_s < (T - c_ds) / g_ds <= (T - min c) / g_ds and
L = sum_s l_s < (T - min c) sum_s 1 / g_ds, so the slowest stage takes at least the bound (integer
cuts and the memory only raise it). The step is ``contention ((M + S - 1) max_s t_s + H + max_i opt_i)
+ step_overhead`` (contention >= 1; the messages on the critical path H and the optimizer step >= 0),
or more on a shared host.

[Note: a micro-batch no rank of a stage holds] A stage's ranks' caps are ``(budget - used) /
share`` with ``used >= compute_memory(m_d)`` at any layer count, clipped at 0: where
``compute_memory(m_d) > budget`` for every rank of a stage, the caps are all 0, the stage fits at no
layer count and no cut of the candidate fits (:func:`.pipeline_search.best_for` finds none).
"""

from __future__ import annotations

import numpy as np

from cephalo_lightning.planner.cost.device_cost import DeviceCost, kind_costs
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.search.pipeline.layouts import StageLayout


def step_bounds(cluster: Cluster, layout: StageLayout, batches: tuple[int, ...], counts: list[int],
                costs: tuple[list[DeviceCost], np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For every micro-batch count of ``counts``: the lower bound on the step (ms) and whether a cut may fit.

    ``costs``: :func:`.device_cost.kind_costs` of ``cluster``, computed once by the caller."""
    kinds, of_rank = costs if costs is not None else kind_costs(cluster)
    M = np.asarray(counts, dtype=np.int64)
    S, L, s = layout.num_stages, cluster.model.num_layers, cluster.settings
    slowest = np.zeros(len(M))
    held = np.zeros((S, len(M)), dtype=bool)  # some rank of the stage holds its micro-batch
    for d, chain in enumerate(layout.chains):
        micro = -(-batches[d] // M)
        inverse = np.zeros(len(M))
        least_overhead = min(kinds[int(of_rank[r])].overhead_ms for r in chain)
        for stage, rank in enumerate(chain):
            cost = kinds[int(of_rank[rank])]
            g = 2 * np.asarray(cost.fwd(micro), dtype=float) + np.asarray(cost.bwd(micro), dtype=float)
            with np.errstate(divide="ignore"):
                inverse = inverse + 1.0 / g
            held[stage] |= np.asarray(cost.compute_memory(micro), dtype=float) <= cost.budget_gb
        with np.errstate(divide="ignore"):
            slowest = np.maximum(slowest, L / inverse + least_overhead)
    return s.host_contention * (M + S - 1) * slowest + s.step_overhead_ms, held.all(axis=0)
