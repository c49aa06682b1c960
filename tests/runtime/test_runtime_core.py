"""The production path: no instrumentation without observers, re-sharding in place, exact plan
switches under a prefetching DataLoader, compile-friendly layers, public torch APIs only."""

from __future__ import annotations

import collections
import gc
import re
import sys
import time
import tracemalloc
import types
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from cephalo_lightning import CephaloStrategy
from cephalo_lightning.runtime import timing
from cephalo_lightning.runtime.emulation import emulator as emulation
from cephalo_lightning.runtime.emulation.memory import MemoryTracker
from cephalo_lightning.runtime.layered import LayeredSchedule, plain_input
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel
from tests.assembly import assemble, assert_matches, rank_pieces
from tests.distributed import run_distributed
from tests.lightning_models import TinyLayered, loader, token_data
from tests.plans import plan_of
from tests.reference import make_optimizer, reference_state, train_reference
from tests.tiny_lm import TinyLM, batches

PACKAGE = Path(__file__).resolve().parents[2] / "cephalo_lightning"


# ----------------------------------------------------------------------------- no observers, no cost


class _CountingClock:
    """Counts clock reads made from the package's own code (Lightning's do not count)."""

    def __init__(self, real) -> None:  # noqa: ANN001 - a time function
        self.real = real
        self.calls = 0

    def __call__(self) -> float:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.startswith("cephalo_lightning"):
            self.calls += 1
        return self.real()


_CONTAINERS = (dict, list, tuple, set, frozenset, collections.deque, types.ModuleType, types.FunctionType,
               types.CellType, types.MethodType)


def package_state(roots: list[object]) -> tuple[int, int]:
    """(objects, bytes) the package holds: everything reachable from ``roots`` through the package's
    own instances, its modules and plain containers (a tensor counts its bytes and is not entered;
    other libraries' objects, such as the trainer or the user's model, are where the walk stops)."""
    seen, stack, count, size = set(), list(roots), 0, 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            count, size = count + 1, size + obj.nelement() * obj.element_size()
            continue
        if isinstance(obj, types.ModuleType) and not obj.__name__.startswith("cephalo_lightning"):
            continue
        if isinstance(obj, types.FunctionType) and not (obj.__module__ or "").startswith("cephalo_lightning"):
            continue
        if not (type(obj).__module__.startswith("cephalo_lightning") or isinstance(obj, _CONTAINERS)):
            count, size = count + 1, size + sys.getsizeof(obj)  # a leaf: an int, a string, another library's object
            continue
        count, size = count + 1, size + sys.getsizeof(obj)
        stack.extend(gc.get_referents(obj))
    return count, size


@pytest.mark.soak
def test_a_real_device_run_without_observers_reads_no_clock_and_keeps_no_state(monkeypatch):
    warnings.simplefilter("ignore")
    perf, mono = _CountingClock(time.perf_counter), _CountingClock(time.monotonic)
    monkeypatch.setattr(time, "perf_counter", perf)
    monkeypatch.setattr(time, "monotonic", mono)
    contention = []
    monkeypatch.setattr(timing.ContentionClock, "now", classmethod(lambda cls: contention.append(1)))
    held, allocated = [], []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step in (400, 1000):  # after warm-up (optimizer state, log keys, caches)
                gc.collect()  # count what is alive, not garbage awaiting collection
                modules = [m for name, m in sys.modules.items() if name.startswith("cephalo_lightning")]
                held.append(package_state([trainer.strategy, *modules]))
                snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, f"{PACKAGE}/*")])
                allocated.append(snapshot)

    plan = plan_of(batches=[4], micro=[2], shares=[1.0], devices=["cpu"])
    trainer = pl.Trainer(strategy=CephaloStrategy(plan=plan), accelerator="cpu", devices=1, max_steps=1000,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Probe()])
    tracemalloc.start()
    try:
        trainer.fit(TinyLayered(), loader(token_data(4000), 4))
    finally:
        tracemalloc.stop()
    sharded = trainer.strategy.sharded
    assert not list(sharded.observers), "no observer is attached on a real (non-emulated) device"
    assert perf.calls == mono.calls == len(contention) == 0, (perf.calls, mono.calls, len(contention))
    # What the package holds (its modules, the strategy and everything they own) is the same after
    # 400 and after 1,000 steps: any history kept per step shows up here, exactly.
    assert held[0] == held[1], f"the package's state grew from {held[0]} to {held[1]} (objects, bytes)"
    # Allocations made from the package's lines also count what torch allocates inside those calls
    # (caches that grow by a few KB in steps); a leak of 100 B per step would add 60 KB.
    grown = sum(s.size for s in allocated[1].statistics("filename")) - sum(s.size for s in allocated[0].statistics("filename"))
    top = [str(stat) for stat in allocated[1].compare_to(allocated[0], "lineno")[:3]]
    assert grown < 48 * 1024, f"memory allocated from the package's lines grew by {grown} B: {top}"


def test_the_strategy_puts_nothing_inside_a_layer_that_would_break_a_compiled_graph():
    model = TinyLM(dim=16)
    layers = [model.embed, *model.blocks, model.norm, model.head]
    sharded = ShardedModel(model, [1.0], units=layers)
    sharded.observers.attach(emulation.DeviceEmulator(2.0))  # instrumentation attached: still outside the layer
    block = model.blocks[1]
    x = torch.randn(2, 5, 16)
    with sharded.scheduled(), sharded.unit_gathered(3):  # as the layered schedule runs it (unit 3: blocks[1])
        explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    with sharded.unit_gathered(3):  # the uniform mode's hooks gather outside block.forward
        explanation = torch._dynamo.explain(block.forward)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons


def _fill_grads(sharded: ShardedModel, value: float) -> list[torch.nn.Parameter]:
    pieces = [p for p in sharded.parameters() if p.numel()]
    for p in pieces:
        p.grad = torch.full_like(p, value)
    return pieces


def _fill_grads_flat(sharded: ShardedModel, value: float) -> list[torch.nn.Parameter]:
    """As a data-parallel step leaves them: views of one flat buffer, the last piece first."""
    pieces = [p for p in sharded.parameters() if p.numel()]
    flat = torch.full((sum(p.numel() for p in pieces),), value)
    at = 0
    for p in reversed(pieces):
        p.grad = flat[at : at + p.numel()].view(p.shape)
        at += p.numel()
    return pieces


@pytest.mark.parametrize("fill", [_fill_grads, _fill_grads_flat])
def test_grads_finite_flags_any_non_finite_element_and_only_those(fill):
    from cephalo_lightning.lightning.steps.step_sync import finish_step
    from cephalo_lightning.runtime.sharding.sharded_model import adjacent_runs

    model = TinyLM(dim=16)
    sharded = ShardedModel(model, [1.0], units=[model.embed, *model.blocks, model.norm, model.head])

    def by_element() -> bool:  # the definition, element by element
        return all(bool(torch.isfinite(p.grad).all()) for p in sharded.parameters() if p.grad is not None)

    assert sharded.grads_finite() and by_element()  # no gradient yet: nothing non-finite
    pieces = fill(sharded, 0.5)
    assert len(pieces) > 3 and sharded.grads_finite() and by_element()
    runs = adjacent_runs([p.grad for p in pieces])  # one sum per run: per piece, or one over the flat buffer
    assert len(runs) == (1 if fill is _fill_grads_flat else len(pieces))
    assert sorted(id(g) for _, members in runs for g in members) == sorted(id(p.grad) for p in pieces)
    assert sum(flat.numel() for flat, _ in runs) == sum(p.numel() for p in pieces)
    gap = pieces[len(pieces) // 2]  # a piece without a gradient cuts the run where it lies
    kept, gap.grad = gap.grad, None
    assert len(adjacent_runs([p.grad for p in pieces if p.grad is not None])) == (2 if fill is _fill_grads_flat
                                                                                 else len(pieces) - 1)
    gap.grad = kept
    big = max(pieces, key=torch.numel)
    cases = {  # name: (make it, every element finite)
        "inf in one element of one piece": (lambda: big.grad.view(-1).__setitem__(7, float("inf")), False),
        "-inf in the last piece": (lambda: pieces[-1].grad.view(-1).__setitem__(-1, float("-inf")), False),
        "nan in one element": (lambda: pieces[1].grad.view(-1).__setitem__(0, float("nan")), False),
        "finite values whose fp32 sum overflows": (lambda: big.grad.fill_(3e38), True),
        "an overflowing piece and an inf in another": (
            lambda: (big.grad.fill_(3e38), pieces[0].grad.view(-1).__setitem__(0, float("inf"))), False),
        "an overflowing piece holding one nan": (
            lambda: (big.grad.fill_(-3e38), big.grad.view(-1).__setitem__(3, float("nan"))), False),
        "+max and -max alternating: partial sums overflow both ways": (
            lambda: (big.grad.fill_(3e38), big.grad.view(-1)[::2].fill_(-3e38)), True),
    }
    for name, (make, finite) in cases.items():
        fill(sharded, 0.5)
        make()
        assert by_element() is finite, name  # the case is what it says
        if "overflow" in name:  # finite elements or not, the piece's fp32 sum is not finite: checked element-wise
            assert not torch.isfinite(big.grad.sum()), name
        assert sharded.grads_finite() is finite, name
        report, _ = finish_step(torch.tensor(1.0), sharded, check_grads=True)
        assert report.nonfinite == (() if finite else (0,)), name
        assert finite or report.what == "gradient", name


def test_the_package_uses_no_private_torch_distributed_api():
    offenders = []
    pattern = re.compile(r"(torch\.distributed|\bdist)\.(_\w+)|_init_from_local_shards|distributed\._shard|_get_default_store")
    for path in PACKAGE.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if pattern.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(PACKAGE)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# ----------------------------------------------------------------------------- re-sharding and plan switches


def _reshard_and_switch(rank: int, world: int):
    warnings.simplefilter("ignore")
    out = {}
    # 1. the runtime: train, re-shard in place with the memory tracker watching, train on
    model = TinyLM(vocab=40, dim=32, depth=3)
    layers = [model.embed, *model.blocks, model.norm, model.head]
    sharded = ShardedModel(model, [0.8, 0.2], units=layers)
    schedule = LayeredSchedule(sharded, layers)
    optimizer = make_optimizer(model.parameters())
    data = batches(4, 8, vocab=40)
    sizes = [5, 3]
    lo = sum(sizes[:rank])

    def step(x, y):
        x, y = x[lo : lo + sizes[rank]], y[lo : lo + sizes[rank]]
        forward_pass = schedule.forward([x], plain_input, lambda k, o, side: model.loss(o, y), [sizes[rank] / 8])
        schedule.backward(forward_pass)
        optimizer.step()
        optimizer.zero_grad()

    for x, y in data[:2]:
        step(x, y)
    old = sharded.local_state_numel()
    bytes_per = 4 * (1 + 2)  # fp32 master and two Adam moments
    tracker = MemoryTracker(baseline_bytes=old * bytes_per)
    with sharded.observers.attached(tracker), tracker:
        sharded.reshard([0.3, 0.7], [optimizer])
    new = sharded.local_state_numel()
    largest_unit = max(u.numel for u in sharded.layout.units)
    out["memory"] = (tracker.peak_bytes, (old + new + largest_unit) * bytes_per, old, new)
    for x, y in data[2:]:
        step(x, y)
    out["pieces"] = rank_pieces(sharded, optimizer)
    # 2. through Trainer.fit: a switch with a prefetching multi-worker DataLoader
    first = plan_of(batches=[9, 3], micro=[3, 1], shares=[0.7, 0.3])
    second = plan_of(batches=[2, 10], micro=[2, 4], shares=[0.1, 0.9])
    switches = []

    class Switch(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                switches.append(trainer.strategy.schedule_plan(second))

    trainer = pl.Trainer(strategy=CephaloStrategy(plan=first), accelerator="cpu", devices=world, max_steps=12,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Switch()], use_distributed_sampler=False)
    data = token_data(12 * 12)
    trainer.fit(TinyLayered(), torch.utils.data.DataLoader(data, batch_size=12, num_workers=2, prefetch_factor=4,
                                                           persistent_workers=False))
    out["switch"] = switches[0]
    out["final_plan"] = trainer.strategy.plan.batch_sizes
    out["fit"] = trainer.strategy.sharded.full_state_dict()
    return out


@pytest.fixture(scope="module")
def switched():
    return run_distributed(_reshard_and_switch, 2)


@pytest.mark.multiprocess
def test_reshard_moves_state_in_place_within_old_plus_new_share_and_trains_on_exactly(switched):
    for peak, bound, old, new in (r["memory"] for r in switched):
        assert peak <= bound, f"re-shard peak {peak} B above old + new share + one unit ({bound} B)"
    assert switched[0]["memory"][3] < switched[0]["memory"][2]  # rank 0 stores less after the re-shard
    want = reference_state(*train_reference(4, 8, model=TinyLM(vocab=40, dim=32, depth=3), vocab=40))
    assert_matches(assemble([r["pieces"] for r in switched]), want)


@pytest.mark.multiprocess
def test_a_plan_switch_is_exact_with_a_prefetching_multi_worker_loader(switched):
    epoch, step = switched[0]["switch"]
    assert epoch == 0 and step > 2, "the switch waits for the batches the workers have already cut"
    assert switched[0]["final_plan"] == [2, 10]
    from tests.helpers import max_error, reference

    want, _ = reference(12, 12, samples=12 * 12)
    assert max_error(switched[0]["fit"], want) <= 1e-5


@pytest.mark.multiprocess
def test_the_gpu_check_runs_its_cpu_skeleton(tmp_path):
    import subprocess

    from tests.conftest import HANG_TIMEOUT_S, clean_env, failure_report

    out = tmp_path / "gpu.md"
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)],
                            capture_output=True, text=True, env=clean_env(), cwd=PACKAGE.parent, timeout=HANG_TIMEOUT_S)
    assert result.returncode == 0, failure_report(result)
    table = out.read_text()
    assert "CPU dry run" in table and "| layered fit (cephalo, 1 rank) | ok |" in table
    assert "two ranks, one GPU: gloo, CPU tensors (dry run) | ok |" in table
