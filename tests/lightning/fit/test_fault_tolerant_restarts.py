"""Whole-job restarts under ``CephaloStrategy(fault_tolerance=True)``: the scenario of
:mod:`scenarios.ft_restarts` (two groups of one rank under ``Trainer.fit``, a seeded shuffled loader
over three data epochs, a lighthouse process): both groups lost in one step, a start at step 0
refused beside the checkpoints, both resumed from one checkpoint through a lighthouse restart to the
uninterrupted single-process run, groups given different seeds stopped at the first quorum. A file
of its own, so the suite's workers run it beside the other fault-tolerance scenarios.
"""

from __future__ import annotations

import signal

import pytest
import torch

from cephalo_lightning.lightning.fit.fault_tolerance import torchft_available
from tests.reference import make_optimizer, tiny_loss, train_steps, whole
from tests.tiny_lm import TinyLM

needs_torchft = pytest.mark.skipif(not torchft_available(),
                                   reason="torchft is not installed (pip install 'cephalo-lightning[ft]'); "
                                          "these tests run on it")
# measured: max |param - replay| = 2.2e-16 for TinyLM in fp64 (the groups' partial sums add in another order);
# a step skipped, repeated or applied with part of its batch is off by ~1e-3
TOLERANCE = 1e-12
LOSS_TOLERANCE = 1e-5  # the logged value passes through float32 (relative 6e-8 of a loss near 3); a group's part is off by > 0.5
DEADLINE_S = 600  # the whole scenario, on a loaded 2-core machine


def shuffled_replay(steps: int, global_batch: int, samples: int, seed: int):
    """TinyLayered's model trained alone in fp64 on the seeded shuffled order's global batches
    (data epoch ``e``: ``randperm(samples)`` seeded ``seed + e``): parameters and each step's loss."""
    from tests.lightning_models import token_data

    data, per_epoch = token_data(samples), samples // global_batch
    chosen = []
    for step in range(steps):
        epoch, at = divmod(step, per_epoch)
        order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed + epoch))
        chosen.append(data[order[at * global_batch:(at + 1) * global_batch]])
    model = TinyLM().double()
    losses = train_steps(make_optimizer(model.parameters()), tiny_loss(model), whole(chosen))
    return {f"model.{name}": p.detach() for name, p in model.named_parameters()}, losses


@pytest.fixture(scope="module")
def restarts(tmp_path_factory):
    from scenarios.ft_restarts import run_restarts

    return run_restarts(tmp_path_factory.mktemp("ft-restarts"), DEADLINE_S)


@needs_torchft
@pytest.mark.multiprocess
def test_every_group_lost_in_one_step_leaves_its_checkpoints_and_a_start_at_step_0_is_refused(restarts):
    from scenarios.ft_restarts import RESUME_AT
    from scenarios.ft_worker import steps_and_epochs

    for group in (0, 1):  # two groups lost in the same step: nothing live is left
        assert restarts.exit_codes["both-lost", group] == -signal.SIGKILL, restarts.logs["both-lost", group]
        assert f"step={RESUME_AT}.ckpt" in restarts.checkpoints[group], restarts.checkpoints
        assert restarts.exit_codes["started-over", group] == 1, restarts.logs["started-over", group]
        log = restarts.logs["started-over", group]
        assert "every replica group starts at step 0, but the run has checkpoints" in log and "ckpt_path" in log, log
        assert ("started-over", group) not in restarts.finals
        assert not steps_and_epochs(restarts.metrics.get(("started-over", group), []))[0]  # not one step trained


@needs_torchft
@pytest.mark.multiprocess
def test_every_group_resumed_from_one_checkpoint_ends_on_the_uninterrupted_replay_through_a_lighthouse_restart(restarts):
    from scenarios.ft_restarts import RESUME_AT, SAMPLES, SEED, TOTAL
    from scenarios.ft_worker import GLOBAL, steps_and_epochs

    want, losses = shuffled_replay(TOTAL, GLOBAL, SAMPLES, SEED)  # 8 steps over 3 seeded data epochs
    assert restarts.lighthouse_restarted
    for group in (0, 1):
        assert restarts.exit_codes["resumed", group] == 0, restarts.logs["resumed", group]
        got = restarts.finals["resumed", group]
        error = max((got[k] - want[k]).abs().max().item() for k in want)
        assert error <= TOLERANCE, (group, error)
        steps, epochs = steps_and_epochs(restarts.metrics["resumed", group])
        assert len(steps) == TOTAL - RESUME_AT, steps  # from the checkpoint's step on, each step once
        assert max(abs(a - b) for a, b in zip(steps, losses[RESUME_AT:])) <= LOSS_TOLERANCE, (steps, losses)
        assert epochs and all(abs(e - sum(s) / len(s)) <= LOSS_TOLERANCE for e, s in epochs), epochs


@needs_torchft
@pytest.mark.multiprocess
def test_groups_given_different_seeds_are_stopped_at_the_first_quorum_naming_them(restarts):
    from scenarios.ft_worker import steps_and_epochs

    for group in (0, 1):
        log = restarts.logs["other-seeds", group]
        assert restarts.exit_codes["other-seeds", group] == 1, log
        assert "at step 0 the groups draw different samples (data order fingerprints by group {" in log, log
        assert not steps_and_epochs(restarts.metrics.get(("other-seeds", group), []))[0]
