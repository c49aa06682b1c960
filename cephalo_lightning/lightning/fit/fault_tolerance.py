"""Each shard group a torchft replica group: a quorum every step, the cross-group gradient sum through
torchft's managed process group, and live recovery of a group that comes back.

One step ``s`` trains on the global batch ``G_s`` (``B`` samples, fixed by the data order, never by
which groups are up). At the step's start every group joins torchft's quorum; the quorum names the
participating groups ``p_0 .. p_{n-1}`` (``n >= 1``, in the quorum's order). The global batch is
split over them by the re-plan over the participants (:mod:`cephalo_lightning.planner.replica_groups`: the
group plan, one :class:`~cephalo_lightning.planner.RankPlan` per group, over the participants'
devices): participant ``k`` trains on ``G_s[o_k : o_k + b_k]`` with ``b`` the re-plan's batches,
``o`` their prefix sums and ``Σ b = B``. Each group's loss is ``Σ_{i in its slice} ℓ_i / B``, so the
sum of the participants' gradients (all-reduce SUMs over the managed process group) is
``∇ (1/B) Σ_{i ∈ G_s} ℓ_i`` whoever participates: the single-process step on the global batch.

[Note: the sum inside the backward] The group's sharded model sums its gradients over the groups
itself (:meth:`ShardedModel.sum_across` given a :class:`ManagedSum`; the runtime's
[Note: a sum across jobs]): rank i of every group holds the same ranges (the groups are cut
alike), so each bucket's all-reduce (groups of one rank) or each unit's (groups of several ranks,
after the in-group reduce-scatter) goes to torchft as soon as it is ready, during the backward, and
the backward waits for them at its end, as the runtime waits its own replica sum. Every
participant issues the same all-reduces in the same order each step: the control sum (names,
fingerprints, seeds: see [Note: one data order]) at :meth:`ReplicaGroup.start_step`, before the
forward; the gradients' during the backward; the logged values in :meth:`ReplicaGroup.finish_sums`,
after it, where the control sum is also compared, before the commit. A redo starts from zeroed
gradients (the fit sets them to None, :meth:`ReplicaGroup.commit` zeroes them), so no attempt's
sum is added twice.

[Note: a group lost mid-step] The others' all-reduce of that step fails (the peer's sockets close) or
their quorum drops it; torchft then answers ``should_commit() == False``, the optimizer is not stepped,
the gradients are dropped, and the survivors **redo** step ``s`` (the same ``G_s``) at the next quorum,
over themselves. No step is lost and none is counted twice: the step counter, which is the sampler's
position, advances only on a commit.

[Note: a group coming back] A new process of the group joins a quorum at a step boundary; torchft's
checkpoint transport sends it a live group's state (this rank's local pieces of the weights, the
optimizer state and the step, i.e. the sampler position) before that step, and it trains on its
slice of the very step the others are on.

[Note: one data order] Every group draws global batch ``G_s`` from the same order: each step the
participants sum, besides their names, a fingerprint of the sample indices of the step each trains
and their data seeds (:meth:`ReplicaGroup.start_step` writes them and starts their small all-reduce,
which runs during the forward: the step waits for no exchange before it; :meth:`ReplicaGroup.finish_sums`
compares them); fingerprints that differ stop every group of the quorum with an error naming each group's
fingerprint and seed (different seeds, data or global batch) before the commit, so no optimizer steps
on them. The data seed also travels with the recovered state:
a group that comes back with another seed says which seed the live groups draw with, and the quorum
stops the run (no group trains on a wrong order, none adopts another's seed silently).

[Note: a lighthouse that comes back] The lighthouse is one process; while it is down no quorum
forms. Each group's manager asks it again (``Settings.quorum_retries`` times, torchft's quorum
retries) until the quorum timeout, so a lighthouse restarted at the same address within it is
rejoined and the step goes on; past it every group fails with torchft's quorum timeout.

What is not survived: a lost rank inside a group takes its whole group down (the in-group collectives
are ordinary ones, and the group's other ranks must be restarted with it); every group lost at once
(nothing holds the live state: resume from a checkpoint); the lighthouse down past the quorum timeout.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from cephalo_lightning._common import vocabulary
from cephalo_lightning._common.errors import ConfigurationError, UnsupportedError
from cephalo_lightning.planner import Cluster, Plan
from cephalo_lightning.planner.replan import replan
from cephalo_lightning.planner.replica_groups import StepSlice, check_groups_cut_alike, survivors_batches
from cephalo_lightning.runtime.sharding.replicas import ReplicaSum

log = logging.getLogger(__name__)

TORCHFT_VERSION = "0.2.0"  # the version .ci/constraints.txt pins; the `ft` extra asks for it


def torchft_available() -> bool:
    try:
        import torchft  # noqa: F401
    except ImportError:
        return False
    return True


def require_torchft() -> Any:
    """The torchft module, or a refusal that says how to install it."""
    try:
        import torchft
    except ImportError as err:
        raise UnsupportedError(
            f"fault tolerance runs on torchft, which is not installed ({err}); install it with "
            f"`pip install 'cephalo-lightning[ft]'` (torchft=={TORCHFT_VERSION})") from err
    return torchft


def check_options(mode: vocabulary.Schedule | vocabulary.Auto, plan: Plan | None) -> None:
    """What ``fault_tolerance=True`` can be refused for before any process starts: the uniform mode, a
    pinned plan whose groups cut the units differently, torchft missing."""
    if mode == vocabulary.Schedule.UNIFORM:
        raise ConfigurationError(
            "CephaloStrategy(fault_tolerance=True, mode='uniform'): when a group is lost, the survivors take its samples "
            "by the re-plan over them, which gives each rank its device's micro-batch size and so more micro-batches on "
            "some ranks than on others; the uniform mode runs one micro-batch count on every rank. Use mode='layered' "
            "(or 'auto' with the layered protocol), or fault_tolerance=False")
    try:
        if plan is not None:
            check_groups_cut_alike(plan)
        require_torchft()
    except (ConfigurationError, UnsupportedError) as err:
        raise type(err)(f"CephaloStrategy(fault_tolerance=True): {err}") from err


def check_fit(plan: Plan, group: int | None) -> None:
    """``Trainer.fit`` under ``CephaloStrategy(fault_tolerance=True)``, at setup: the plan names every
    group (its shard groups, cut alike) and ``group`` is one of them."""
    try:
        check_groups_cut_alike(plan)
    except ConfigurationError as err:
        raise ConfigurationError(f"CephaloStrategy(fault_tolerance=True): {err}") from err
    if group is None or not 0 <= group < len(plan.shard_groups):
        raise ConfigurationError(
            f"CephaloStrategy(fault_tolerance=True, replica_group={group!r}): give this node's shard group, 0 to "
            f"{len(plan.shard_groups) - 1} of the plan's {len(plan.shard_groups)} (replica_group=, or the "
            "REPLICA_GROUP_ID environment variable)")


def _sum(op: dist.ReduceOp = dist.ReduceOp.SUM) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


class ManagedSum:
    """This rank's sum over the participating groups (rank i of each) as the runtime starts it
    ([Note: the sum inside the backward]): an all-reduce over torchft's managed process group, whose
    errors torchft records (the step then does not commit) rather than raises. ``issued``: the
    all-reduces started so far."""

    def __init__(self, managed: Any) -> None:
        self.managed = managed
        self.issued = 0

    def start_all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, name: str = "") -> Any:
        self.issued += 1
        return self.managed.allreduce([tensor], _sum(op))


class SumsAcross(Protocol):
    """A sharded model that sums its gradients over jobs beyond its world (:class:`ShardedModel`)."""

    def sum_across(self, across: ReplicaSum | None) -> None: ...


def quorum_process_group(timeout: timedelta) -> Any:
    """torchft's reconfigurable gloo group, recording the groups of each quorum it is configured for.

    torchft configures it once per new quorum with ``global_ranks``: replica ``i`` of the quorum (its
    replica id's trailing digits, ``cephalo_group_<g>``, times the group's size, plus the rank) in the
    quorum's order, so ``global_ranks[k] // group_world_size`` is participant ``k``'s group: the
    participants are known when the quorum is, with no exchange before the forward. The names are
    still summed and compared before the commit (:meth:`ReplicaGroup.finish_sums`)."""
    from torchft.process_group import ProcessGroupGloo

    class QuorumGloo(ProcessGroupGloo):
        groups: tuple[int, ...] | None = None  # the last quorum's groups, in its order

        def configure(self, store_addr: str, replica_id: str, rank: int, world_size: int, quorum_id: int | None = None,
                      group_rank: int | None = None, group_world_size: int | None = None,
                      global_ranks: list[int] | None = None) -> None:
            self.groups = (tuple(r // group_world_size for r in global_ranks)
                           if global_ranks is not None and group_world_size else None)
            super().configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                              global_ranks)

    return QuorumGloo(timeout=timeout)


class DataOrder(Protocol):
    """A group's data order as the quorum compares it (the planned loader's sampler is one)."""

    seed: int

    def fingerprint(self, step: int) -> int: ...


def check_one_order(step: int, participants: Sequence[int], fingerprints: Sequence[int],
                    seeds: Sequence[int]) -> None:
    """Refuse a step whose participants draw different samples (see [Note: one data order]);
    ``fingerprints[k]``, ``seeds[k]``: participant ``k``'s, -1 where it gave none."""
    given = {g: f for g, f in zip(participants, fingerprints) if f >= 0}
    if len(set(given.values())) > 1:
        by_seed = {g: s for g, s, f in zip(participants, seeds, fingerprints) if f >= 0}
        raise ConfigurationError(
            f"Cephalo fault tolerance: at step {step} the groups draw different samples (data order fingerprints by "
            f"group {given}, data seeds {by_seed}): their data seeds, training data or global batch differ, and no "
            "group trains on another's order. Give every group the same CephaloStrategy(seed=...) (or "
            "seed_everything), the same training set and the same plan")


def predicted_step_s(plan: Plan, participants: Sequence[int], cluster: Cluster | None) -> float | None:
    """The step time the re-plan predicts for ``participants``: the planner's for their devices (from
    ``cluster``), else the plan's predicted step scaled by the throughput the participants keep
    (``t * B / sum of their planned batches``); None when neither is known."""
    members = [plan.shard_groups[g] for g in participants]
    devices = [plan.ranks[r].device for ranks in members for r in ranks]
    if cluster is not None and set(devices) <= {d.name for d in cluster.devices}:
        new, _ = replan(None, cluster, devices, plan.global_batch_size, plan.mode)
        return new.predicted_step_s
    if plan.predicted_step_s is None:
        return None
    kept = sum(plan.ranks[r].batch_size for ranks in members for r in ranks)
    return plan.predicted_step_s * plan.global_batch_size / kept if kept else None


def phase_line(participants: Sequence[int], groups: int, first: int, commits: int, measured: float,
               predicted: float | None, global_batch: int) -> str:
    """One phase of the fit over the same participants, for the log."""
    kind = "all groups" if len(participants) == groups else f"degraded, {len(participants)} of {groups} groups"
    guess = f"predicted {predicted:.4f} s by the re-plan" if predicted is not None else \
        "no prediction (the plan carries no predicted step time; give a cluster file)"
    return (f"steps {first}-{first + commits - 1} over groups {list(participants)} ({kind}): measured "
            f"{measured:.4f} s per step ({global_batch / measured:.1f} samples/s), {guess}")


@dataclass(frozen=True)
class Settings:
    """How a group reaches torchft: the lighthouse (``host:port``, or ``TORCHFT_LIGHTHOUSE``), this
    group's TCPStore (``MASTER_ADDR``/``MASTER_PORT`` when unset), and the bounds on every wait."""

    lighthouse: str | None = None
    store_addr: str | None = None
    store_port: int | None = None
    timeout: timedelta = timedelta(seconds=30)
    quorum_timeout: timedelta = timedelta(seconds=60)
    connect_timeout: timedelta = timedelta(seconds=30)
    heartbeat_interval: timedelta = timedelta(milliseconds=100)
    hostname: str | None = None  # what this group's manager advertises to the others (unset: this host's name)
    quorum_retries: int = 10  # a quorum request the lighthouse failed is asked again (a restarted lighthouse)


class ReplicaGroup:
    """One shard group (this rank's part of it) as a torchft replica group; see the module notes.

    ``parameters``: this rank's local pieces (what its optimizer steps), the same ranges as rank
    ``i`` of every other group; ``sharded``: the group's sharded model, which is given the sum over
    the groups ([Note: the sum inside the backward]); ``plan``: every group's ranks (its shard
    groups are the replica groups, cut alike: :func:`check_groups_cut_alike`); ``group``: this
    group's index among them;
    ``cluster``: re-plan the survivors from its profiles (:func:`survivors_batches`);
    ``sampler_state``/``load_sampler_state``: the data order's position beyond the step (an epoch, a
    seed), sent to a group that comes back with the weights.
    """

    def __init__(self, parameters: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer, plan: Plan,
                 group: int, settings: Settings, *, sharded: SumsAcross, cluster: Cluster | None = None, rank: int = 0,
                 world_size: int = 1,
                 sampler_state: Callable[[], dict[str, Any]] = dict,
                 load_sampler_state: Callable[[dict[str, Any]], None] = lambda state: None) -> None:
        torchft = require_torchft()
        from torchft.process_group import ManagedProcessGroup

        if not 0 <= group < len(plan.shard_groups):
            raise ConfigurationError(f"group={group}: the plan has {len(plan.shard_groups)} shard groups (0 to "
                                     f"{len(plan.shard_groups) - 1}); give this node's group index")
        check_groups_cut_alike(plan)
        self.parameters = list(parameters)
        self.optimizer = optimizer
        self.plan = plan
        self.cluster = cluster
        self.group, self.rank = group, rank
        self._sampler_state, self._load_sampler_state = sampler_state, load_sampler_state
        self._pg = quorum_process_group(settings.timeout)
        self.manager = torchft.Manager(
            pg=self._pg, load_state_dict=None, state_dict=None, min_replica_size=1,
            use_async_quorum=False, timeout=settings.timeout, quorum_timeout=settings.quorum_timeout,
            connect_timeout=settings.connect_timeout, rank=rank, world_size=world_size,
            store_addr=settings.store_addr, store_port=settings.store_port,
            lighthouse_addr=settings.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE"),
            replica_id=f"cephalo_group_{group}", heartbeat_interval=settings.heartbeat_interval, init_sync=True,
            quorum_retries=settings.quorum_retries,
            **({"hostname": settings.hostname} if settings.hostname else {}))
        self.manager.register_state_dict_fn("weights", self._load_weights, self._weights)
        self.manager.register_state_dict_fn("optimizer", self.optimizer.load_state_dict, self.optimizer.state_dict)
        self.manager.register_state_dict_fn("sampler", self._load_sampler_state, self._sampler_state)
        self.managed = ManagedProcessGroup(self.manager)  # the cross-group reduction: quorum-sized, errors reported
        self.sum = ManagedSum(self.managed)
        sharded.sum_across(self.sum)  # the gradients' sum over the groups runs in the backward
        self._participants: tuple[int, ...] = ()  # the last quorum's groups (a change is re-planned and logged)
        self._batches: tuple[int, ...] = ()  # their samples of every global batch
        self.redone = 0  # steps this group started and did not commit (redone at the next quorum)
        self._part: StepSlice | None = None  # the step in progress
        self._check: torch.Tensor | None = None  # the step's names, fingerprints and seeds, summed before the commit
        self._check_work: Any = None  # their all-reduce, started with the step
        self._quorum: tuple[int, ...] | None = None  # the groups they must name (None: the step's quorum broke)
        self.history: list[tuple[StepSlice, bool]] = []  # every step this group trained: its part, committed
        self._phase: tuple[int, float, int, float | None] | None = None  # the participants' phase: first step, time, commits, prediction

    @property
    def step(self) -> int:
        """The committed steps: the sampler's position (the next step trains on global batch ``step``)."""
        return self.manager.current_step()

    def _weights(self) -> dict[str, torch.Tensor]:
        return {str(i): p.detach() for i, p in enumerate(self.parameters)}

    @torch.no_grad()
    def _load_weights(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.parameters):
            raise RuntimeError(f"a live group sent {len(state)} weight pieces for this rank's {len(self.parameters)}: "
                               "the groups do not cut the units alike")
        for i, p in enumerate(self.parameters):
            p.copy_(state[str(i)])

    def resume_at(self, step: int) -> None:
        """This group starts at committed step ``step`` (a checkpoint's): the quorum compares it with the
        others' (a group behind recovers the live state)."""
        state = self.manager.state_dict()
        self.manager.load_state_dict({**state, "step": step})

    def start_step(self, order: DataOrder | None = None) -> StepSlice:
        """Join this step's quorum (recovering the live state first when this group is behind) and
        return the part of the step's global batch this group trains on. ``order``: this group's data
        order, whose fingerprint of the step and seed are compared over the participants (see the
        module notes)."""
        self.manager.start_quorum()
        n, k = self.manager.num_participants(), self.manager.participating_rank()
        m = max(n, 1)
        errored = self.manager.errored() is not None
        # the groups' names, their fingerprints, their seeds: summed during the forward, compared before the commit
        self._check = None if errored else torch.zeros(3 * m, dtype=torch.float64)
        self._check_work = self._quorum = None
        if errored or k is None:
            # the quorum already broke: this step will not commit; train on the whole batch, dropped later
            self._start_check()
            self._part = StepSlice(self.step, 0, self.plan.global_batch_size, (self.group,), (self.plan.global_batch_size,))
            return self._part
        participants = self._pg.groups
        if participants is None or len(participants) != n or participants[k] != self.group:
            raise RuntimeError(f"Cephalo fault tolerance: torchft configured group {self.group} as participant {k} of "
                               f"{n} in a quorum of groups {participants}; its replica ids must be cephalo_group_<g>")
        self._check[k], self._quorum = self.group + 1, participants
        if order is not None:
            self._check[m + k], self._check[2 * m + k] = order.fingerprint(self.step) + 1, order.seed + 1
        self._start_check()
        if participants != self._participants:
            self._end_phase()
            self._batches, how = survivors_batches(self.plan, participants, self.cluster)
            if self.rank == 0:  # once per group
                log.warning("Cephalo fault tolerance: from step %d the groups %s train the global batch of %d as %s "
                            "(re-planned over the groups present %s)", self.step, list(participants),
                            self.plan.global_batch_size, list(self._batches), how)
            self._participants = participants
            self._phase = (self.step, time.perf_counter(), 0, predicted_step_s(self.plan, participants, self.cluster))
        batches = self._batches
        self._part = StepSlice(self.step, sum(batches[:k]), batches[k], participants, batches)
        return self._part

    def _start_check(self) -> None:
        """Start the step's control sum ([Note: the sum inside the backward]): the first all-reduce
        of the step on every participant."""
        if self._check is not None:
            self._check_work = self.managed.allreduce([self._check], _sum())

    @torch.no_grad()
    def finish_sums(self, values: torch.Tensor | None = None) -> None:
        """After the backward (whose gradients the sharded model summed over the participating groups):
        sum ``values`` in place (the step's logged values, each group's part of them) and compare
        the control sum started with the step (names, fingerprints, seeds: :meth:`_compare`)."""
        value_work = summed = None
        if values is not None and values.numel():
            summed = values.to(torch.float64)
            value_work = self.managed.allreduce([summed], _sum())
        if self._check_work is not None:
            self._check_work.wait()
            self._check_work = None
            assert self._check is not None
            self._compare(self._check)
        if value_work is not None:
            value_work.wait()
            values.copy_(summed)

    def _compare(self, summed: torch.Tensor) -> None:
        """The step's names, fingerprints and seeds as summed over the participants: the quorum's order
        of groups as every participant saw it, and one data order (:func:`check_one_order`)."""
        if self.manager.errored() is not None or self._quorum is None or self._part is None:
            return  # the quorum or the sum broke: the step does not commit
        n = summed.numel() // 3
        every = [int(v) - 1 for v in summed.tolist()]  # one host sync
        names = tuple(every[:n])
        if names != self._quorum:
            raise RuntimeError(f"Cephalo fault tolerance: the quorum's groups {list(self._quorum)} (as torchft "
                               f"configured this group) differ from the names the participants sent {list(names)}")
        check_one_order(self._part.step, names, every[n:2 * n], every[2 * n:])

    def agree(self) -> bool:
        """Whether every participating group finished this step (torchft's ``should_commit``, which
        advances :attr:`step` when it does); when not, the step is redone at the next quorum."""
        committed = self.manager.should_commit()
        if self._part is not None:
            self.history.append((self._part, committed))
        if committed and self._phase is not None:
            first, started, commits, predicted = self._phase
            self._phase = (first, started, commits + 1, predicted)
        if not committed:
            self.redone += 1
            if self.rank == 0:
                log.warning("Cephalo fault tolerance: step %d did not commit on group %d (a group was lost mid-step); "
                            "it is redone over the groups of the next quorum", self.step, self.group)
        return committed

    def commit(self) -> bool:
        """Step the optimizer if every participating group finished this step (:meth:`agree`);
        otherwise drop the gradients, and the step is redone. Returns whether it committed."""
        committed = self.agree()
        if committed:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return committed

    def _end_phase(self) -> None:
        """Log the steps committed over the last participants: the measured step beside the re-plan's prediction."""
        if self._phase is None or self.rank != 0:
            return
        first, started, commits, predicted = self._phase
        if commits:
            measured = (time.perf_counter() - started) / commits
            log.warning("Cephalo fault tolerance: %s", phase_line(self._participants, len(self.plan.shard_groups),
                                                                  first, commits, measured, predicted,
                                                                  self.plan.global_batch_size))

    def shutdown(self) -> None:
        self._end_phase()
        self._phase = None
        self.manager.shutdown(wait=False)
