"""One device kind's cost: a rank's per-layer time and its memory at any batch, micro-batch count
and state share, in one mode (:class:`DeviceCost`).

Per transformer layer, with F(m), B(m) one layer's forward (no grad) and backward time at
micro-batch size m (the profiler's B is recompute-with-grad plus backward minus F), AG / RS the
all-gather and reduce-scatter of one layer (:mod:`cephalo_lightning.planner.cost.collective_prices`), c
the overhead of one extra micro-batch, X the host copy of one sample's stashed layer input (zero
unless ``settings.offload_stash``), and ``comb(comm, compute) = max + (1 - overlap) * min``
(overlap 1: communication hides behind compute, ``max``; overlap 0: serial, ``comm + compute``; an
unmeasured overlap is priced at 0, see [Note: an unmeasured overlap])::

    layered, recomputing (the default):
        fwd_i = comb(AG,      sum_k F(s_k) + b X)
        bwd_i = comb(AG + RS, sum_k (F(s_k) + B(s_k)) + b X + (n_i - 1) c)
    layered, one micro-batch keeping its autograd graph (RankPlan.recompute = False):
        fwd_i = comb(AG, F(b)),   bwd_i = comb(AG + RS, B(b))
    uniform (micro-batch-major: every micro-batch gathers every layer, graph kept, one RS):
        fwd_i = comb(G_i AG,      sum_k F(s_k))
        bwd_i = comb(G_i AG + RS, sum_k B(s_k) + (n_i - 1) c)
        G_i = 1 + (n_i - 1) q    (q: settings.repeated_gather_fraction, 1 unless calibrated: a
                                  layer's first gather in a pass also holds the ranks' wait for
                                  each other, its repeats only the transfer)
    step_i = contention * (num_layers * (fwd_i + bwd_i) + optimizer_ns_per_param_i * r_i * trainable) + step_overhead

where s_1..s_n are rank i's near-equal micro-batch sizes and r_i its state share (the optimizer
updates only the rank's own share); ``contention`` and ``step_overhead`` come from a calibration
(one and zero without). F, B and the memory series are the device's profile as
:mod:`cephalo_lightning.planner.cost.compute_curves` reads it at any size. Memory of rank i::

    compute_memory_i(m_i) [+ activation_memory_i(m_i) when the graph is kept]
        [+ compute_bytes_per_param * trainable in uniform mode with n_i > 1: the whole model's
           unsharded gradient accumulates, in the compute dtype, until the last micro-batch]
        [+ b_i * model.kept_bytes in layered mode, recomputing, with ``settings.stash_on_device``:
           the stash (every layer's input of every sample, and the last layer's outputs until the
           loss) held between the two passes; measured by the profiler]
        + reserved + (state_bytes + reduction_bytes) * r_i  <=  usable_memory_fraction * memory_i

    state_bytes = state_bytes_per_param * trainable + weight_bytes_per_param * frozen
    reduction_bytes = 2 * largest_reduced_parameters * grad_bytes_per_param

(:class:`~cephalo_lightning.planner.schema.cluster_spec.ModelSpec`): every parameter's stored weight, and the
gradient and optimizer moments of the trainable ones only (LoRA: the frozen base costs its weights),
and ``reduction_bytes`` what a unit's reduce-scatter holds per share: two shards of the largest
unit's trainable part (the exact one's receive buffer and sum; the padded one's sum and the copy of
the rank's range; where every parameter trains the exact sum is the rank's gradient, so this is a
shard over). Compute memory holds the unit's flat gradient itself. The all-gathers move every
parameter of a layer, the reduce-scatters its trainable ones only (a frozen parameter has no
gradient in the runtime's reduction). The shares r_i are water-filled under the memory's
caps (:func:`water_fill`).

Memory is in GiB (2**30 bytes), as ``torch.cuda`` reports it; times in milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields

import numpy as np

from cephalo_lightning._common.units import GIB
from cephalo_lightning._common.vocabulary import Schedule, values_of
from cephalo_lightning.planner.cost.calibration import calibrated
from cephalo_lightning.planner.cost.compute_curves import PiecewiseLinear
from cephalo_lightning.planner.cost.prices import Prices
from cephalo_lightning.planner.schema.cluster_spec import Cluster, DeviceProfile, Settings
from cephalo_lightning.planner.schema.planning_error import PlanningError


def combine(comm: np.ndarray | float, compute: np.ndarray | float, overlap: float) -> np.ndarray:
    """Time of communication and compute that overlap by ``overlap`` (1: max, 0: sum)."""
    return np.maximum(comm, compute) + (1.0 - overlap) * np.minimum(comm, compute)


def step_ms(settings: Settings, work_ms: np.ndarray | float) -> np.ndarray | float:
    """A step's time from its work (``work_ms``: the layers' passes and the optimizer step): stretched
    by the host's contention, plus the fixed per-step overhead (the module's ``step_i``)."""
    return settings.host_contention * work_ms + settings.step_overhead_ms


def slowdown_of(device: DeviceProfile) -> float:
    """A device's emulated slowdown (1: not emulated): the share 1 / slowdown of its compute is real."""
    return 1.0 if device.emulate is None else float(device.emulate.slowdown)


class DeviceCost:
    """One device's cost functions under a cluster's settings, in one mode (layered | uniform)."""

    def __init__(self, device: DeviceProfile, cluster: Cluster, mode: Schedule = Schedule.LAYERED) -> None:
        if mode not in values_of(Schedule):
            raise PlanningError(f"mode must be one of {values_of(Schedule)}, got {mode!r}; choose one of those")
        self.device = device
        self.mode = Schedule(mode)
        self.fwd = PiecewiseLinear(device.layer_fwd_ms)
        self.bwd = PiecewiseLinear(device.layer_bwd_ms)
        self.compute_memory = PiecewiseLinear(device.compute_memory_gb, intercept_at_zero=True)
        self.activation_memory = (None if device.activation_memory_gb is None
                                  else PiecewiseLinear(device.activation_memory_gb))
        s, model = cluster.settings, cluster.model
        self.overhead_ms = s.micro_batch_overhead_ms
        self.settings = s
        self.overlap = s.priced_overlap
        self.num_layers = model.num_layers
        self.budget_gb = s.usable_memory_fraction * device.memory_gb - s.reserved_memory_gb
        self.state_gb = model.state_bytes / GIB
        # what a unit share costs: its state, and the reduce-scatter's buffers of the largest unit
        self.share_gb = (model.state_bytes + model.reduction_bytes_per_share) / GIB
        self.grad_gb = model.compute_bytes_per_param * model.trainable / GIB  # uniform accumulation
        ns = device.optimizer_ns_per_param
        if ns is None:
            ns = s.optimizer_ns_per_param or 0.0
        self.optimizer_ms_per_share = ns * model.trainable / 1e6  # the whole state's step (trainable only), ms
        stash = model.stash_bytes
        gbps = device.host_copy_gbps or s.host_copy_gbps
        copies = s.offload_stash and mode == Schedule.LAYERED and stash is not None
        self.copy_ms_per_sample = stash / (gbps * 1e9) * 1e3 if copies else 0.0  # one direction, one layer
        # a recomputing layered rank keeps every sample's stash on the device between the passes
        self.kept_gb_per_sample = model.kept_bytes / GIB if s.stash_on_device and mode == Schedule.LAYERED else 0.0
        self.slowdown = slowdown_of(device)
        # keeping the graph is priced only where its memory was measured
        self.can_keep = mode == Schedule.LAYERED and self.activation_memory is not None

    # ------------------------------------------------------------------ time

    def sums(self, b: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer sums over n near-equal micro-batches of F and of B (b >= n >= 1)."""
        q, rem = np.divmod(b, n)
        f, bw = self.fwd, self.bwd
        f_sum = (n - rem) * f(q) + rem * f(q + 1)
        b_sum = (n - rem) * bw(q) + rem * bw(q + 1)
        return f_sum, b_sum

    def compute_parts(self, b: np.ndarray, n: np.ndarray, keep: np.ndarray | bool = False
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer compute (forward pass, backward pass incl. overheads) of b samples in n micro-batches."""
        b = np.asarray(b, dtype=np.int64)
        n = np.maximum(np.asarray(n, dtype=np.int64), 1)
        f_sum, b_sum = self.sums(np.maximum(b, n), n)
        over = (n - 1) * self.overhead_ms
        if self.mode == Schedule.UNIFORM:
            fwd, bwd = f_sum, b_sum + over
        else:
            copy = self.copy_ms_per_sample * b
            fwd, bwd = f_sum + copy, f_sum + b_sum + copy + over
            kept = np.asarray(keep, dtype=bool) & (n == 1)
            if kept.any():
                fwd = np.where(kept, f_sum, fwd)
                bwd = np.where(kept, b_sum, bwd)
        empty = b == 0
        return np.where(empty, 0.0, fwd), np.where(empty, 0.0, bwd)

    def gathers(self, n: np.ndarray | int) -> np.ndarray:
        """Each layer's gathers per pass, in units of its first: uniform mode gathers once per
        micro-batch, each repeat at ``settings.repeated_gather_fraction``; layered mode once."""
        n = np.asarray(n, dtype=float)
        if self.mode != Schedule.UNIFORM:
            return np.ones_like(n)
        return 1.0 + (np.maximum(n, 1.0) - 1.0) * self.settings.repeated_gather_fraction

    def collectives(self, n: np.ndarray, prices: Prices) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer communication of the forward and the backward pass."""
        gathers = self.gathers(n)
        return gathers * prices.ag, gathers * prices.ag + prices.rs

    def layer_ms(self, b: np.ndarray, n: np.ndarray, prices: Prices,
                 keep: np.ndarray | bool = False) -> np.ndarray:
        """Per-layer time of b samples in n micro-batches (b = 0: the collectives alone)."""
        fwd, bwd = self.pass_ms(b, n, prices, keep)
        return fwd + bwd

    def pass_ms(self, b: np.ndarray, n: np.ndarray, prices: Prices,
                keep: np.ndarray | bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per-layer time of the forward and of the backward pass, each with its collectives."""
        fwd, bwd, a1, a2 = self._passes(b, n, prices, keep)
        return combine(a1, fwd, self.overlap), combine(a2, bwd, self.overlap)

    def _passes(self, b: np.ndarray, n: np.ndarray, prices: Prices, keep: np.ndarray | bool
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-layer (forward compute, backward compute, forward communication, backward communication)."""
        n = np.maximum(np.asarray(n, dtype=np.int64), 1)
        return (*self.compute_parts(b, n, keep), *self.collectives(n, prices))

    def blocked_ms(self, b: np.ndarray, n: np.ndarray, prices: Prices,
                   keep: np.ndarray | bool = False) -> np.ndarray:
        """Per-layer time spent in collectives beyond the compute they overlap (what a host
        blocked in them measures)."""
        fwd, bwd, a1, a2 = self._passes(b, n, prices, keep)
        return combine(a1, fwd, self.overlap) - fwd + combine(a2, bwd, self.overlap) - bwd

    def optimizer_ms(self, share: np.ndarray | float) -> np.ndarray:
        return self.optimizer_ms_per_share * np.asarray(share, dtype=float)

    def compute_ms(self, batch_size: int, num_micro_batches: int, recompute: bool = True) -> tuple[float, float]:
        """Per-layer compute for one step: (forward pass, backward pass incl. any recompute and overheads)."""
        fwd, bwd = self.compute_parts(np.array([batch_size]), np.array([num_micro_batches]), not recompute)
        return float(fwd[0]), float(bwd[0])

    def step_s(self, batch_size: int, num_micro_batches: int, prices: Prices,
               share: float = 0.0, recompute: bool = True) -> float:
        layer = float(self.layer_ms(np.array([batch_size]), np.array([num_micro_batches]), prices,
                                    not recompute)[0])
        return step_ms(self.settings, self.num_layers * layer + float(self.optimizer_ms(share))) / 1e3

    # ------------------------------------------------------------------ memory

    def extra_memory_gb(self, m: np.ndarray, n: np.ndarray | int = 1, keep: np.ndarray | bool = False,
                        b: np.ndarray | int | None = None) -> np.ndarray:
        """Memory beyond compute_memory(m): the kept graph, uniform mode's accumulating gradients and,
        given the batch b, the stash a recomputing layered rank keeps on the device."""
        m = np.asarray(m, dtype=np.int64)
        extra = np.zeros(m.shape)
        if b is not None and self.kept_gb_per_sample:
            extra = extra + self.stash_gb(b, keep)
        graph = self.activation_memory is not None and (self.mode == Schedule.UNIFORM or np.any(keep))
        if graph:
            act = self.activation_memory(m)
            extra = extra + (act if self.mode == Schedule.UNIFORM else np.where(keep, act, 0.0))
        if self.mode == Schedule.UNIFORM:
            extra = extra + np.where(np.asarray(n) > 1, self.grad_gb, 0.0)
        return extra

    def stash_gb(self, b: np.ndarray | int, keep: np.ndarray | bool = False) -> np.ndarray:
        """The stash b samples keep on the device between the passes (0 when kept graphs replace it)."""
        return np.where(np.asarray(keep, dtype=bool), 0.0, np.asarray(b, dtype=float) * self.kept_gb_per_sample)

    def memory_gb(self, micro_batch_size: int, share: float, reserved_gb: float, num_micro_batches: int = 1,
                  recompute: bool = True, batch_size: int | None = None) -> float:
        m = np.array([micro_batch_size])
        extra = float(self.extra_memory_gb(m, num_micro_batches, not recompute, batch_size)[0])
        return float(self.compute_memory(micro_batch_size)) + extra + reserved_gb + self.share_gb * share

    def room(self, m: np.ndarray, n: np.ndarray | int = 1, keep: np.ndarray | bool = False,
             b: np.ndarray | int | None = None) -> np.ndarray:
        """Largest state share that fits beside compute at micro-batch size m (may be < 0); with the
        batch b, beside its stash too (without: the room before the stash, an upper bound)."""
        m = np.asarray(m, dtype=np.int64)
        used = self.compute_memory(m) + self.extra_memory_gb(m, n, keep, b)
        return (self.budget_gb - used) / self.share_gb

    def max_share(self, micro_batch_size: int, num_micro_batches: int = 1, recompute: bool = True,
                  batch_size: int | None = None) -> float:
        """Largest state share that fits beside compute at this micro-batch size (may be < 0)."""
        return float(self.room(np.array([micro_batch_size]), num_micro_batches, not recompute, batch_size)[0])


_KIND_FIELDS = tuple(f.name for f in fields(DeviceProfile) if f.name != "node")


def _without_node(device: DeviceProfile) -> tuple:
    """What makes a device kind: everything but its node (cheaper than a replaced profile)."""
    return tuple(getattr(device, name) for name in _KIND_FIELDS)


def kind_costs(cluster: Cluster, mode: Schedule = Schedule.LAYERED) -> tuple[list[DeviceCost], np.ndarray]:
    """One DeviceCost per distinct device profile, and each rank's index into them."""
    cluster = calibrated(cluster)
    index: dict[DeviceProfile, int] = {}
    costs: list[DeviceCost] = []
    of_rank = np.empty(cluster.world_size, dtype=np.int64)
    known: dict[int, int] = {}  # id(device) -> kind: ranks of one entry share one profile object
    for rank, device in enumerate(cluster.devices):
        k = known.get(id(device))
        if k is None:
            key = device if device.node is None else _without_node(device)  # one kind across nodes
            k = index.get(key)
            if k is None:
                k = index[key] = len(costs)
                costs.append(DeviceCost(device, cluster, mode))
            known[id(device)] = k
        of_rank[rank] = k
    return costs, of_rank


def water_fill(caps: Sequence[float], counts: Sequence[int] | None = None) -> list[float] | None:
    """Shares r_i <= caps_i summing to 1 with the smallest possible maximum, or None.

    r_i = min(cap_i, level) for the level at which they sum to 1: every rank keeps the same share
    until its memory is full, which also keeps collectives as even as the memory allows. With
    ``counts``, entry i stands for counts[i] ranks that each take r_i.
    """
    caps_arr = np.maximum(np.asarray(caps, dtype=float), 0.0)
    weight = np.ones(len(caps_arr)) if counts is None else np.asarray(counts, dtype=float)
    if (caps_arr * weight).sum() < 1.0 - 1e-12:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(200):
        level = (lo + hi) / 2
        if (np.minimum(caps_arr, level) * weight).sum() >= 1.0:
            hi = level
        else:
            lo = level
    shares = np.minimum(caps_arr, hi)
    shares /= (shares * weight).sum()
    return [float(s) for s in shares]
