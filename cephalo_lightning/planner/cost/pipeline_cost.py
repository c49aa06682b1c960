"""The cost model of a pipelined plan: every rank's micro-step, memory and share, and the step.

A pipelined plan cuts the model's L layers into S contiguous stages of l_s layers. Pipeline d is a
chain of S ranks, one per stage, taking B_d samples in M near-equal micro-batches of at most
m_d = ceil(B_d / M); the ranks of stage s over all pipelines form the stage's shard group (D ranks,
shares r_i of the stage's state). Per micro-batch, rank i of stage s (F, B one layer's forward and
backward at m_d, :mod:`.device_cost`; c the overhead of a micro-batch; AG, RS one layer's all-gather
and reduce-scatter over the stage's group, :mod:`.collective_prices`)::

    u_i = comb((l_s - t_bf / M) AG, l_s F) + comb((l_s - t_fb / M) AG + l_s RS, l_s (F + B) + c)
                                                                  (each layer recomputed)
    p_i = m_d a / link(i, prev) + m_d a / link(i, next)  [+ latency per message crossing nodes]

where t_fb and t_bf count the stage's turns from a forward to a backward and back in one step (the
runtime keeps the layer at a turn gathered: the backward starts on the layer the forward ended on,
and the forward on the one the backward ended on; :func:`turns`), and ``a`` is one sample's
activation at a stage boundary (``model.stash_bytes``: seq_len x
hidden_size x compute bytes), sent forward and its gradient backward, over the intra-node link or,
between nodes, the inter-node one (GB/s per rank, as the collectives price them). The gathers and
the reduction run per micro-batch: the stage's ranks never hold the stage's whole gradient. The
ranks of one stage wait for each other in every collective, so the stage's micro-step is its
slowest rank's, and the pipelines advance together. One message across cut j (between stages j
and j + 1, either way) takes h_j, the slowest pipeline's (:meth:`PipelineCost.hops_ms`)::

    t_s = max_{i in stage s} u_i,        t = max_s t_s   (GPipe: t >= max_j h_j, one message a cut a micro-step)
    h_j = max_d m_d a / link(chain_d[j], chain_d[j + 1])  [+ latency across nodes]
    step = contention * ((M + S - 1) * t + H + max_i opt_i) + step_overhead
    H = 2 sum_j h_j                                                (GPipe)
    H = 2 sum_j h_j + 2 floor((M - 1)(S - 1) / S) max_j h_j        (1F1B)
    step >= step_overhead + sum_i busy_i / slowdown_i / host_cores   (ranks sharing a host's cores)

(:func:`exposed_hops_ms`; [Note: point-to-point on the critical path]). The bubble is
(S - 1) / (M + S - 1) of the compute. ``opt_i`` is the optimizer step of the rank's share of its
stage's state. Memory of rank i::

    compute_memory(m_d) + k_s m_d l_s a + reserved + r_i (l_s / L state_bytes + reduction_bytes)
        <= usable_memory_fraction * memory_i
    k_s = M (GPipe: every micro-batch's stash before the first backward)
    k_s = min(M, S - s) (1F1B: stage s holds at most S - s micro-batches in flight)

(each in-flight micro-batch keeps every layer's input of the stage, as the layered mode's stash).
The shares are water-filled over the stage group's room (:func:`.device_cost.water_fill`). The
model's parameters are spread over its layers evenly (``parameters / num_layers`` a layer), as the
collectives price them.

[Note: point-to-point on the critical path] A stage blocks in a receive and has nothing else to
compute meanwhile, so a message's time overlaps no compute of the stage waiting for it. The first
micro-batch crosses every cut forward and its gradient every cut back before the pipeline is full
and after it drains: 2 sum_j h_j, under both schedules. GPipe's later messages travel while both
stages compute other micro-batches (a stage runs every forward, then every backward), so nothing
more is exposed. 1F1B alternates a forward and a backward once the pipeline is full: stage s's
next forward waits on stage s - 1, which sends it only after the backward that waited on stage s's
gradient, a round trip of 2 h over the cut per micro-batch, of which the stages' slack (stage s
holds S - s micro-batches in flight) hides all but floor((M - 1)(S - 1) / S) over the step. For
equal stages and cuts this is the step of the runtime's action order
(:mod:`cephalo_lightning.runtime.pipelining.schedule`) with blocking receives, exactly; with unequal
cuts the slowest cut's round trips price every exposed one, an upper bound (tests: a timed run of
the schedules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cephalo_lightning._common.units import GIB
from cephalo_lightning._common.vocabulary import PipelineSchedule
from cephalo_lightning.planner.cost.collective_prices import link_prices
from cephalo_lightning.planner.cost.device_cost import DeviceCost, combine, kind_costs, slowdown_of, step_ms
from cephalo_lightning.planner.schema.cluster_spec import Cluster
from cephalo_lightning.planner.schema.planning_error import PlanningError


@dataclass(frozen=True)
class PipelineShape:
    """Which rank computes which stage of which pipeline, and the batch each pipeline takes."""

    chains: tuple[tuple[int, ...], ...]  # pipeline d's ranks, stage 0 first
    batches: tuple[int, ...]  # B_d
    num_micro_batches: int  # M, every pipeline's

    @property
    def num_stages(self) -> int:
        return len(self.chains[0])

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        return tuple(chain[stage] for chain in self.chains)


def in_flight(schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int) -> int:
    """Micro-batches whose stash stage ``stage`` holds at once: M (GPipe), min(M, S - s) (1F1B)."""
    if schedule == PipelineSchedule.GPIPE:
        return num_micro_batches
    return min(num_micro_batches, num_stages - stage)


def turns(schedule: PipelineSchedule, num_micro_batches: int, num_stages: int, stage: int) -> tuple[int, int]:
    """How often stage ``stage`` turns from a forward to a backward, and from a backward to a forward,
    in one step: GPipe once and never; 1F1B, after w = min(M, S - 1 - s) warm-up forwards, M - w and
    M - w - 1 (once and never where w = M)."""
    M = num_micro_batches
    warmup = M if schedule == PipelineSchedule.GPIPE else min(M, num_stages - 1 - stage)
    return (1, 0) if warmup >= M else (M - warmup, M - warmup - 1)


def exposed_hops_ms(schedule: PipelineSchedule, num_micro_batches: int, hops_ms: np.ndarray | list[float]) -> float:
    """H: the point-to-point time on the step's critical path, from one message's time across each of
    the S - 1 cuts ([Note: point-to-point on the critical path]): 2 sum_j h_j (GPipe), plus
    2 floor((M - 1)(S - 1) / S) max_j h_j round trips (1F1B)."""
    hops = np.asarray(hops_ms, dtype=float)
    if not len(hops):
        return 0.0
    fill_and_drain = 2.0 * float(hops.sum())
    if PipelineSchedule(schedule) == PipelineSchedule.GPIPE:
        return fill_and_drain
    S = len(hops) + 1
    return fill_and_drain + 2.0 * ((num_micro_batches - 1) * (S - 1) // S) * float(hops.max())


def bubble_fraction(num_micro_batches: int, num_stages: int) -> float:
    """The share of the step a stage waits in the pipeline's fill and drain: (S - 1) / (M + S - 1)."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def activation_bytes(cluster: Cluster) -> float:
    """One sample's activation at a stage boundary, in bytes (its gradient is as large)."""
    a = cluster.model.stash_bytes
    if a is None:
        raise PlanningError("pricing a pipeline needs the activation a stage sends: give the model's hidden_size and "
                            "seq_len (or stash_bytes_per_sample) in the cluster file")
    return a


def send_ms(cluster: Cluster, across: bool, nbytes: float) -> float:
    """One point-to-point message of ``nbytes`` between two ranks (ms), ``across`` nodes or inside one:
    over the inter-node link's share per rank plus its latency, or the intra-node link; 0 with
    ``free_links``."""
    s = cluster.settings
    if s.free_links:
        return 0.0
    gbps = (s.inter_node_bandwidth_gbps or s.link_bandwidth_gbps) if across else s.link_bandwidth_gbps
    if not gbps:
        raise PlanningError("pricing a pipeline's point-to-point sends needs the link bandwidths: write "
                            "link_bandwidth (and inter_node_bandwidth between nodes) in the cluster file's settings")
    return nbytes / (gbps * 1e9) * 1e3 + (s.inter_node_latency_ms if across else 0.0)


@dataclass(frozen=True)
class StagePrice:
    """One stage at a given layer count: its ranks' micro-steps (ms), memory (GiB), shares; fits."""

    micro_step_ms: np.ndarray  # u_i of the stage's ranks (t_s is their max), in the order of PipelineShape.stage_ranks
    compute_ms: np.ndarray  # u_i
    send_ms: np.ndarray  # p_i: the rank's sends a micro-batch (priced on the step's critical path as H)
    memory_gb: np.ndarray
    shares: np.ndarray
    optimizer_ms: np.ndarray
    busy_ms: np.ndarray  # the step's compute alone (M micro-batches and the optimizer), for a shared host
    fits: bool


class PipelineCost:
    """Prices a stage of a shape at any layer count, and a whole pipelined plan."""

    def __init__(self, cluster: Cluster, shape: PipelineShape, schedule: PipelineSchedule) -> None:
        self.cluster, self.shape, self.schedule = cluster, shape, PipelineSchedule(schedule)
        if any(b < shape.num_micro_batches for b in shape.batches):
            raise PlanningError(f"pipeline batches {list(shape.batches)} cannot all be split into "
                                f"{shape.num_micro_batches} micro-batches; use at most {min(shape.batches)}")
        self.costs, self.of_rank = kind_costs(cluster)
        self.act = activation_bytes(cluster)
        self.links = link_prices(cluster)
        self.micro = np.array([-(-b // shape.num_micro_batches) for b in shape.batches], dtype=np.int64)
        self.nodes = cluster.nodes

    def _cost(self, rank: int) -> DeviceCost:
        return self.costs[int(self.of_rank[rank])]

    def sends_ms(self, stage: int) -> np.ndarray:
        """p_i of the stage's ranks: activations forward to the next stage, gradients back to the previous."""
        S, out = self.shape.num_stages, []
        for d, chain in enumerate(self.shape.chains):
            nbytes = self.micro[d] * self.act
            total = 0.0
            for other in ((chain[stage + 1],) if stage + 1 < S else ()) + ((chain[stage - 1],) if stage > 0 else ()):
                total += send_ms(self.cluster, self.nodes[chain[stage]] != self.nodes[other], nbytes)
            out.append(total)
        return np.array(out)

    def hops_ms(self) -> np.ndarray:
        """h_j of every cut j (between stages j and j + 1): one micro-batch's activation, or its gradient,
        across it, the slowest pipeline's (0 with ``free_links``)."""
        S = self.shape.num_stages
        out = np.zeros(S - 1)
        for d, chain in enumerate(self.shape.chains):
            nbytes = self.micro[d] * self.act
            for j in range(S - 1):
                out[j] = max(out[j], send_ms(self.cluster, self.nodes[chain[j]] != self.nodes[chain[j + 1]], nbytes))
        return out

    def stage(self, stage: int, layers: int) -> StagePrice:
        """Stage ``stage`` computing ``layers`` layers: shares water-filled under memory, then times."""
        return self.stage_table(stage, np.array([layers]))[0]

    def stage_table(self, stage: int, layers: np.ndarray) -> list[StagePrice]:
        """:meth:`stage` at every layer count of ``layers`` at once (arrays: the stage's ranks x counts)."""
        model, s = self.cluster.model, self.cluster.settings
        ranks = self.shape.stage_ranks(stage)
        M, S = self.shape.num_micro_batches, self.shape.num_stages
        k = in_flight(self.schedule, M, S, stage)
        costs = [self._cost(r) for r in ranks]
        l = np.asarray(layers, dtype=float)[None, :]
        fraction = l / model.num_layers
        share_gb = (model.state_bytes * fraction + model.reduction_bytes_per_share) / GIB
        m = self.micro[:, None]
        used = np.array([[float(c.compute_memory(self.micro[d]))] for d, c in enumerate(costs)])
        used = used + k * m * l * self.act / GIB
        budget = np.array([[c.budget_gb] for c in costs])
        shares, fits = water_fill_columns((budget - used) / share_gb)
        nodes = np.array([self.nodes[i] for i in ranks])
        if s.free_links:
            ag = rs = np.zeros(l.shape)
        else:
            prices = self.links.one_group(len(ranks), bool(nodes.min() != nodes.max()), shares.max(axis=0))
            ag, rs = np.asarray(prices.ag)[None, :], np.asarray(prices.rs)[None, :]
        f = np.array([[float(c.fwd(self.micro[d]))] for d, c in enumerate(costs)])
        b = np.array([[float(c.bwd(self.micro[d]))] for d, c in enumerate(costs)])
        over = np.array([[c.overhead_ms] for c in costs])
        fb, bf = turns(self.schedule, M, S, stage)
        u = (combine((l - bf / M) * ag, l * f, s.priced_overlap)
             + combine((l - fb / M) * ag + l * rs, l * (f + b) + over, s.priced_overlap))
        p = self.sends_ms(stage)[:, None]
        w = u  # the sends are priced on the step's critical path ([Note: point-to-point on the critical path])
        optimizer = np.array([[c.optimizer_ms_per_share] for c in costs]) * shares * fraction
        memory = used + s.reserved_memory_gb + shares * share_gb
        busy = M * (l * (2 * f + b) + over) + optimizer
        p = np.broadcast_to(p, w.shape)
        return [StagePrice(w[:, j], u[:, j], p[:, j], memory[:, j], shares[:, j], optimizer[:, j], busy[:, j],
                           bool(fits[j])) for j in range(w.shape[1])]

    def step_ms(self, stages: list[StagePrice]) -> float:
        """The step of every pipeline (they advance together): fill, M micro-steps of the slowest stage
        and drain, the point-to-point messages on the critical path (H), then the slowest optimizer step."""
        M, S = self.shape.num_micro_batches, self.shape.num_stages
        slowest = max(float(p.micro_step_ms.max()) for p in stages)
        hops = self.hops_ms()
        if self.schedule == PipelineSchedule.GPIPE and len(hops):
            slowest = max(slowest, float(hops.max()))  # a cut carries M messages each way back to back
        optimizer = max(float(p.optimizer_ms.max()) for p in stages)
        exposed = exposed_hops_ms(self.schedule, M, hops)
        step = float(step_ms(self.cluster.settings, (M + S - 1) * slowest + exposed + optimizer))
        cores = self.cluster.settings.host_cores
        if cores:  # ranks sharing one host's cores: their real compute spread over the cores
            real = sum(float((p.busy_ms / [slowdown_of(self.cluster.devices[r]) for r in self.shape.stage_ranks(i)]).sum())
                       for i, p in enumerate(stages))
            step = max(step, real / cores + self.cluster.settings.step_overhead_ms)
        return step

    def cross_node_bytes(self) -> float:
        """Bytes per step that cross between nodes: each cut between two nodes carries every sample's
        activation forward and its gradient back."""
        total = 0.0
        for d, chain in enumerate(self.shape.chains):
            for a, b in zip(chain, chain[1:]):
                if self.nodes[a] != self.nodes[b]:
                    total += 2 * self.shape.batches[d] * self.act
        return total


def water_fill_columns(caps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`.device_cost.water_fill` of every column of ``caps`` (ranks x cases) at once: shares
    ``min(cap, level)`` summing to 1 per column, and whether the column's caps reach 1 (where they do
    not, the shares are even, for pricing only)."""
    caps = np.maximum(np.asarray(caps, dtype=float), 0.0)
    fits = caps.sum(axis=0) >= 1.0 - 1e-12
    lo, hi = np.zeros(caps.shape[1]), np.ones(caps.shape[1])
    for _ in range(60):
        level = (lo + hi) / 2
        enough = np.minimum(caps, level).sum(axis=0) >= 1.0
        hi = np.where(enough, level, hi)
        lo = np.where(enough, lo, level)
    shares = np.minimum(caps, hi)
    total = shares.sum(axis=0)
    shares = np.where(fits, shares / np.where(total > 0, total, 1.0), 1.0 / caps.shape[0])
    return shares, fits


def busy_s(cluster: Cluster, plan: Any) -> list[float]:
    """Every rank's predicted compute seconds per step under a pipelined ``plan`` (a
    :class:`~cephalo_lightning.planner.schema.plan.Plan`): its stage's M micro-batches and its optimizer
    step; 0 for an idle rank."""
    chains = plan.pipelines
    M = plan.ranks[chains[0][0]].num_micro_batches
    shape = PipelineShape(chains, tuple(plan.ranks[c[0]].batch_size for c in chains), M)
    cost = PipelineCost(cluster, shape, plan.pipeline_schedule)
    out = [0.0] * len(plan.ranks)
    for s, layers in enumerate(plan.stage_layers):
        price = cost.stage(s, layers)
        for d, rank in enumerate(shape.stage_ranks(s)):
            out[rank] = float(price.busy_ms[d]) / 1e3
    return out
