"""A training DataLoader's own sampler or batch sampler is refused at setup, never silently replaced.

The planned loader draws every global batch itself; a ``WeightedRandomSampler`` (class balancing)
or a custom ``batch_sampler`` it replaced would train on samples the user's sampler never draws.
"""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler, WeightedRandomSampler

from cephalo_lightning import CephaloStrategy
from cephalo_lightning._common.errors import UnsupportedError
from cephalo_lightning.lightning._private import user_sampler
from cephalo_lightning.runtime.plan_state import PlanState
from cephalo_lightning.runtime.sampler import planned_loader
from tests.helpers import trainer
from tests.lightning_models import TinyLayered, token_data
from tests.plans import plan_of

DATA = token_data(24)
PLAN = plan_of(batches=[3, 5], micro=[1, 1], shares=[0.5, 0.5])


class LengthBuckets(Sampler[list[int]]):
    """A custom batch sampler (e.g. bucketing by length)."""

    def __iter__(self):
        return iter([list(range(i, i + 4)) for i in range(0, len(DATA), 4)])

    def __len__(self) -> int:
        return len(DATA) // 4


def _weighted() -> WeightedRandomSampler:
    return WeightedRandomSampler(torch.linspace(0.1, 1.0, len(DATA)), num_samples=len(DATA),
                                 generator=torch.Generator().manual_seed(0))


REFUSED = [
    ("weighted", lambda: DataLoader(DATA, batch_size=8, sampler=_weighted()), "WeightedRandomSampler"),
    ("weighted-under-lightning",  # what Lightning hands over with use_distributed_sampler=True
     lambda: DataLoader(DATA, batch_size=4, sampler=DistributedSamplerWrapper(_weighted(), num_replicas=2, rank=0)),
     "WeightedRandomSampler"),
    ("with-replacement", lambda: DataLoader(DATA, batch_size=8, sampler=RandomSampler(DATA, replacement=True)),
     "RandomSampler with replacement"),
    ("batch-sampler", lambda: DataLoader(DATA, batch_sampler=LengthBuckets()), "batch_sampler (LengthBuckets)"),
]


@pytest.mark.parametrize(("make", "named"), [case[1:] for case in REFUSED], ids=[case[0] for case in REFUSED])
def test_a_custom_sampler_is_refused_naming_it_and_the_fix(make, named):
    loader = make()
    with pytest.raises(UnsupportedError) as err:  # the sampler as the strategy hands it over
        planned_loader(loader, PlanState(PLAN), 0, shuffle=True, seed=0, sampler=user_sampler(loader.sampler))
    message = str(err.value)
    assert named in message, message
    assert "would replace" in message and "Subset" in message and "DistributedSampler" in message, message


@pytest.mark.parametrize("make", [
    lambda: DataLoader(DATA, batch_size=8),
    lambda: DataLoader(DATA, batch_size=8, shuffle=True),
    lambda: DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, num_replicas=2, rank=1)),
    lambda: DataLoader(DATA, batch_sampler=BatchSampler(RandomSampler(DATA), 8, drop_last=True)),
], ids=["sequential", "random", "distributed", "default-batch-sampler"])
def test_the_default_samplers_are_still_cut_by_the_plan(make):
    batches = list(planned_loader(make(), PlanState(PLAN), 1, shuffle=False, seed=0).batch_sampler)
    assert batches == [[3, 4, 5, 6, 7], [11, 12, 13, 14, 15], [19, 20, 21, 22, 23]]


def test_a_fit_with_a_weighted_sampler_stops_at_setup_before_any_step():
    one_rank = plan_of(batches=[8], micro=[1], shares=[1.0])
    t = trainer(CephaloStrategy(plan=one_rank), 1, 2)
    with pytest.raises(UnsupportedError, match="WeightedRandomSampler"):
        t.fit(TinyLayered(), DataLoader(DATA, batch_size=8, sampler=_weighted()))
    assert t.global_step == 0


# ----------------------------------------------------------------------------- a position and a fingerprint

def _sampler(shuffle: bool = True, seed: int = 3):
    from cephalo_lightning.runtime.sampler import PlannedBatchSampler

    return PlannedBatchSampler(len(DATA), PlanState(PLAN), 0, shuffle=shuffle, seed=seed, whole=True)


def test_seek_starts_the_next_iteration_at_a_step_of_the_whole_order():
    steps_per_epoch = len(DATA) // PLAN.global_batch_size  # 3
    walked = _sampler()
    drawn = []
    for epoch in range(4):  # the order an uninterrupted run draws, epoch after epoch
        walked.set_epoch(epoch)
        drawn += list(walked)
    for step in (0, 2, 3, 8):
        moved = _sampler()
        moved.seek(step)
        assert (moved.epoch, moved.consumed) == divmod(step, steps_per_epoch)
        end = (step // steps_per_epoch + 1) * steps_per_epoch  # the end of the data epoch it lands in
        moved.set_epoch(4)  # Lightning's epoch number (any): the position stays
        assert list(moved) == drawn[step:end]
        moved.set_epoch(5)  # Lightning's next epoch: the data epoch after it
        assert list(moved) == drawn[end:end + steps_per_epoch]
    with pytest.raises(ValueError, match=r"seek\(-1\)"):
        _sampler().seek(-1)


def test_the_fingerprint_names_the_samples_of_a_global_batch():
    import zlib

    one, same, other = _sampler(seed=3), _sampler(seed=3), _sampler(seed=4)
    for step in range(6):
        epoch, at = divmod(step, 3)
        want = one.order(epoch)[at * 8:(at + 1) * 8]  # an independent reading of the batch's indices
        assert one.fingerprint(step) == zlib.crc32(want.to(torch.int64).numpy().tobytes())
        assert one.fingerprint(step) == same.fingerprint(step)
    assert [one.fingerprint(s) for s in range(6)] != [other.fingerprint(s) for s in range(6)]
    assert _sampler(shuffle=False).fingerprint(4) == _sampler(shuffle=False, seed=9).fingerprint(4)
