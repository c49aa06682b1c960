"""Layered gradient accumulation: per-rank micro-batch counts, fixed collectives, flat memory."""

from __future__ import annotations

import copy

import pytest
import torch

from cephalo_lightning.runtime.emulation.memory import MemoryTracker
from cephalo_lightning.runtime.layered import LayeredSchedule, plain_input
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel
from tests.assembly import assemble, assert_matches, rank_pieces
from tests.distributed import run_distributed
from tests.reference import make_optimizer, reference_state, split, train_reference
from tests.tiny_lm import TinyLM, batches, layers_of

STEPS = 3


def train_layered(rank: int, shares, batch_sizes, micro_batches, mode="padded", offload=False):
    model = TinyLM()
    layers = layers_of(model)
    sharded = ShardedModel(model, shares, units=layers, collective=mode, record_collectives=True)
    schedule = LayeredSchedule(sharded, layers, offload=offload)
    optimizer = make_optimizer(model.parameters())
    total = sum(batch_sizes)
    lo = sum(batch_sizes[:rank])
    per_step = []
    for x, y in batches(STEPS, total):
        x, y = x[lo : lo + batch_sizes[rank]], y[lo : lo + batch_sizes[rank]]
        sizes = split(batch_sizes[rank], micro_batches[rank])
        starts = [sum(sizes[:k]) for k in range(len(sizes))]
        xs = [x[s : s + n] for s, n in zip(starts, sizes)]
        ys = [y[s : s + n] for s, n in zip(starts, sizes)]
        before = len(sharded.comm.log)
        forward_pass = schedule.forward(xs, plain_input, lambda k, out, side: model.loss(out, ys[k]), [n / total for n in sizes])
        schedule.backward(forward_pass)
        per_step.append(sharded.comm.log[before:])
        optimizer.step()
        optimizer.zero_grad()
    return rank_pieces(sharded, optimizer), per_step


CASES = {
    3: [
        ([0.6, 0.3, 0.1], [2, 6, 4], [1, 3, 4], "padded", False),
        ([0.2, 0.0001, 0.7999], [7, 0, 5], [2, 1, 5], "exact", True),  # b=0 rank, offloaded stash
    ],
    2: [([0.3, 0.7], [9, 3], [4, 1], "padded", True), ([0.5, 0.5], [1, 11], [1, 6], "exact", False)],
}


def _cases(rank: int, world: int):
    return [train_layered(rank, *case) for case in CASES[world]]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-ranks", "3-ranks"])
def layered_run(request):
    return request.param, run_distributed(_cases, request.param)


@pytest.mark.multiprocess
def test_different_micro_batch_counts_match_single_process(layered_run):
    world, results = layered_run
    want = reference_state(*train_reference(STEPS, 12))
    for i in range(len(CASES[world])):
        assert_matches(assemble([r[i][0] for r in results]), want)


@pytest.mark.multiprocess
def test_collectives_per_step_are_identical_and_independent_of_micro_batches(layered_run):
    world, results = layered_run
    num_layers = len(layers_of(TinyLM()))
    for i in range(len(CASES[world])):
        steps = [r[i][1] for r in results]  # per rank: per step: the collective log
        for rank_steps in steps:
            for log in rank_steps:
                assert log == steps[0][0]  # same on every rank, every step, whatever n_i
        ops = [op for op, name, _ in steps[0][0] if name != "<root>"]
        assert ops.count("all_gather") == 2 * num_layers
        assert ops.count("reduce_scatter") == num_layers


def _peak_bytes(n: int, layered: bool, micro: int = 4) -> tuple[int, int]:
    """Peak accounted device bytes (and host bytes) of one step with n micro-batches of size micro."""
    model = TinyLM(vocab=64, dim=64, depth=6)
    layers = layers_of(model)
    sharded = ShardedModel(model, [1.0], units=layers if layered else None)
    data = torch.randint(0, 64, (n * micro, 33), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    xs = [x[k * micro : (k + 1) * micro] for k in range(n)]
    ys = [y[k * micro : (k + 1) * micro] for k in range(n)]
    tracker = MemoryTracker()
    with sharded.observers.attached(tracker), tracker:  # the tracker hears of resized buffers and the stash
        if layered:
            schedule = LayeredSchedule(sharded, layers, offload=True)
            forward_pass = schedule.forward(xs, plain_input, lambda k, out, side: model.loss(out, ys[k]), [1 / n] * n)
            schedule.backward(forward_pass)
        else:
            for k in range(n):
                sharded.set_requires_gradient_sync(k == n - 1)
                sharded.backward(model.loss(model(xs[k]), ys[k]) / n)
    return tracker.peak_bytes, tracker.peak_host_bytes


def test_layered_peak_memory_does_not_grow_with_micro_batches():
    one, one_host = _peak_bytes(1, layered=True)
    eight, eight_host = _peak_bytes(8, layered=True)
    assert eight / one <= 1.10, (one, eight)
    assert eight_host > 4 * one_host  # the stash grows, but on the (emulated) host
    mb_one, _ = _peak_bytes(1, layered=False)
    mb_eight, _ = _peak_bytes(8, layered=False)
    assert mb_eight / mb_one > eight / one  # micro-batch-major keeps unsharded grads resident


def _layered_steps(unit_wise: bool) -> tuple[dict[str, torch.Tensor], int]:
    """3 layered steps of TinyLM, the optimizer stepped at the end or unit by unit; (params, peak)."""
    from scenarios.unit_optimizers import UnitOptimizers

    model = TinyLM(vocab=64, dim=32, depth=4)
    layers = layers_of(model)
    sharded = ShardedModel(model, [1.0], units=layers)
    units = UnitOptimizers(sharded, make_optimizer) if unit_wise else None
    schedule = LayeredSchedule(sharded, layers, on_unit_reduced=units.step_unit if units else None)
    optimizer = None if unit_wise else make_optimizer(model.parameters())
    tracker = MemoryTracker(baseline_bytes=sharded.local_state_numel() * 4)
    with sharded.observers.attached(tracker), tracker:
        for x, y in batches(3, 8, vocab=64):
            xs, ys = [x[:4], x[4:]], [y[:4], y[4:]]
            forward_pass = schedule.forward(xs, plain_input, lambda k, out, side: model.loss(out, ys[k]), [0.5, 0.5])
            schedule.backward(forward_pass)
            if optimizer is not None:
                optimizer.step()
                optimizer.zero_grad()
    return sharded.full_state_dict(), tracker.peak_bytes


def test_unit_wise_optimizer_steps_equal_the_full_step_and_hold_less_gradient():
    whole, whole_peak = _layered_steps(unit_wise=False)
    unit_wise, unit_peak = _layered_steps(unit_wise=True)
    for name, value in whole.items():
        assert torch.equal(unit_wise[name], value), name  # AdamW is elementwise: same update
    print(f"peak: step at the end {whole_peak} B, unit by unit {unit_peak} B ({unit_peak / whole_peak:.3f})")
    assert unit_peak < whole_peak


def _one_micro_batch(kind: str, micro_batches: int = 1) -> tuple[int, int, dict[str, torch.Tensor], float]:
    """One step (of one micro-batch unless told): (peak accounted bytes, loss evaluations, local gradients, loss)."""
    model = TinyLM(vocab=64, dim=64, depth=6)
    layers = layers_of(model)
    sharded = ShardedModel(model, [1.0], units=layers if kind != "plain" else None)
    data = torch.randint(0, 64, (8, 33), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    calls = []

    xs, ys = x.chunk(micro_batches), y.chunk(micro_batches)

    def loss(k, out, side):
        calls.append(k)
        return model.loss(out, ys[k])

    tracker = MemoryTracker()
    with sharded.observers.attached(tracker), tracker:
        if kind == "plain":  # one autograd graph of the whole model and its loss: what keeping the graph costs
            value = model.loss(model(x), y)
            sharded.backward(value)
        else:
            schedule = LayeredSchedule(sharded, layers, offload=False)
            forward_pass = schedule.forward(list(xs), plain_input, loss, [1.0 / micro_batches] * micro_batches,
                                            recompute=kind == "recompute")
            schedule.backward(forward_pass)
            value = forward_pass.loss
    grads = {name: p.grad.clone() for name, p in sharded.named_parameters()}
    return tracker.peak_bytes, len(calls), grads, float(value.detach())


def test_a_kept_graph_computes_the_loss_once_with_the_same_gradients_and_no_more_memory():
    kept_peak, kept_calls, kept, kept_loss = _one_micro_batch("keep")
    _, recomputed_calls, recomputed, recomputed_loss = _one_micro_batch("recompute")
    plain_peak, _, plain, plain_loss = _one_micro_batch("plain")
    # the recomputing schedule keeps the last micro-batch's graph of the last layer too (the backward starts there)
    assert kept_calls == recomputed_calls == 1
    assert kept_loss == recomputed_loss == plain_loss
    assert kept.keys() == recomputed.keys() == plain.keys()
    assert all(torch.equal(kept[n], recomputed[n]) for n in kept)
    assert all(torch.equal(kept[n], plain[n]) for n in kept)  # the same ops in the same order (measured: bitwise)
    # The loss's graph is kept from the forward to the backward, where it was built before anyway:
    # the peak stays that of one plain autograd step of the whole model (measured 1.024x: the
    # detached copies of each layer's output the schedule hands on).
    assert kept_peak <= 1.05 * plain_peak, (kept_peak, plain_peak)


def test_recomputing_evaluates_every_loss_once_in_the_forward_and_all_but_the_last_again():
    _, calls, grads, loss = _one_micro_batch("recompute", micro_batches=4)
    _, _, plain, plain_loss = _one_micro_batch("plain")
    assert calls == 4 + 3  # the last micro-batch's loss keeps its graph from the forward
    assert loss == pytest.approx(plain_loss, rel=1e-6)
    # four micro-batches of two samples against one batch of eight: the same gradient up to fp32 round-off
    # (measured 1.5e-8 on gradients up to 0.037)
    assert all(torch.allclose(grads[n], plain[n], rtol=0, atol=1e-7) for n in plain)


def test_evaluate_is_the_forward_with_nothing_left_for_a_backward():
    """The loss check's pass: the model's loss (an unsharded copy's, the reference), every unit
    freed after it and nothing kept for a backward (the forward after it runs as a step's)."""
    model = TinyLM()
    reference = copy.deepcopy(model)
    layers = layers_of(model)
    sharded = ShardedModel(model, [1.0], units=layers)
    schedule = LayeredSchedule(sharded, layers, offload=True)
    (x, y), = batches(1, 4)
    with torch.no_grad():
        want = float(reference.loss(reference(x), y))
    loss = lambda k, out, side: model.loss(out, y)  # noqa: E731
    got = schedule.evaluate([x], plain_input, loss, [1.0])
    assert float(got) == pytest.approx(want, rel=1e-6) and not got.requires_grad
    assert not any(unit.gathered for unit in sharded.units)
    forward_pass = schedule.forward([x], plain_input, loss, [1.0])
    assert float(forward_pass.loss) == float(got)
    schedule.backward(forward_pass)


def test_a_forward_pass_is_backpropagated_once():
    """[Note: one backward per forward] The caller holds the pass: its backward consumes it (the
    stash and the graphs go with it), and a second backward of it is refused before any collective,
    whatever kind of pass (recomputing, or keeping its graph)."""
    model = TinyLM()
    layers = layers_of(model)
    sharded = ShardedModel(model, [1.0], units=layers, record_collectives=True)
    schedule = LayeredSchedule(sharded, layers, offload=False)
    (x, y), = batches(1, 4)
    loss = lambda k, out, side: model.loss(out, y)  # noqa: E731
    for recompute in (True, False):
        forward_pass = schedule.forward([x], plain_input, loss, [1.0], recompute=recompute)
        assert not forward_pass.consumed
        schedule.backward(forward_pass)
        assert forward_pass.consumed and not forward_pass.stash and not forward_pass.graphs
        issued = len(sharded.comm.log)
        with pytest.raises(RuntimeError, match="already been backpropagated"):
            schedule.backward(forward_pass)
        assert len(sharded.comm.log) == issued  # refused before it gathered anything
        assert not any(unit.gathered for unit in sharded.units)
