"""What sharded ranks hold, put back together and compared with single-process training:

    full[name][start : start + len(values)] = values   for every rank's piece (start, values) of name

each element written exactly once (NaN marks one nobody owns)."""

from __future__ import annotations

import torch

TOL = 1e-5
# Adam moments are compared relative to the tensor's largest entry: every second moment here is
# below 1.6e-5, so an absolute bound of TOL would let a moment half its true value pass. The noise
# floor, single-process training on the same batches cut rank by rank and micro-batch by
# micro-batch (the same training, its sums re-associated), lands at most 6.4e-7 of the largest
# entry from the whole-batch run, for every cut tests/runtime/test_runtime.py's SHARE_CASES uses;
# the runtime measured at most 8.6e-7. The bound is three times the floor.
MOMENT_RTOL = 2e-6
MOMENTS = ("exp_avg", "exp_avg_sq")


def rank_pieces(sharded, optimizer: torch.optim.Optimizer,
           trainable_only: bool = False) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's pieces of every parameter (``trainable_only``: of the trainable ones) and Adam
    moment: name -> (start within the flattened parameter, values)."""
    out = {}
    for unit in sharded.units:
        for index, (span, p) in enumerate(zip(unit.spans, unit.local_params)):
            if trainable_only and not p.requires_grad:
                continue
            start, _ = unit.local_range(index)
            out[span.name] = (start, p.detach().reshape(-1).clone())
            for key in MOMENTS:
                if key in optimizer.state.get(p, {}):
                    out[f"{span.name}.{key}"] = (start, optimizer.state[p][key].detach().reshape(-1).clone())
    return out


def strategy_pieces(strategy, trainable_only: bool = False) -> dict[str, tuple[int, torch.Tensor]]:
    """:func:`rank_pieces` of a fit under the Cephalo strategy."""
    return rank_pieces(strategy.sharded, strategy.optimizers[0], trainable_only)


def assemble(per_rank: list[dict[str, tuple[int, torch.Tensor]]],
             dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Full flattened tensors from every rank's pieces; each element must come exactly once."""
    sizes: dict[str, int] = {}
    for held in per_rank:
        for name, (start, values) in held.items():
            sizes[name] = max(sizes.get(name, 0), start + values.numel())
    full = {name: torch.full((n,), float("nan"), dtype=dtype) for name, n in sizes.items()}
    for held in per_rank:
        for name, (start, values) in held.items():
            window = full[name][start : start + values.numel()]
            assert torch.isnan(window).all(), f"{name}: an element is owned twice"
            window.copy_(values)
    return full


def assert_matches(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Every element owned, parameters within :data:`TOL`, moments within :data:`MOMENT_RTOL` of their largest entry."""
    assert set(got) == set(want)
    for name in want:
        assert not torch.isnan(got[name]).any(), f"{name}: an element is owned by nobody"
        err = (got[name] - want[name]).abs().max().item()
        if name.rsplit(".", 1)[-1] in MOMENTS:
            scale = want[name].abs().max().item()
            assert err <= MOMENT_RTOL * scale, (
                f"{name}: max abs difference {err:.2e} > {MOMENT_RTOL} x the largest entry {scale:.2e}")
        else:
            assert err <= TOL, f"{name}: max abs difference {err:.2e} > {TOL}"
