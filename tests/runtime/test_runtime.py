"""The uneven sharding runtime against single-process training on the global batch (gloo ranks)."""

from __future__ import annotations

import random

import pytest
import torch

from cephalo_lightning.runtime import checkpoint
from cephalo_lightning.runtime.observers import Observer
from cephalo_lightning.runtime.sharding.layout import build_layout, quotas
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel
from cephalo_lightning.runtime.sharding.wrap_policy import WrapPolicyError, find_units
from tests.assembly import TOL, assemble, assert_matches, rank_pieces
from tests.distributed import run_distributed
from tests.reference import make_optimizer, reference_state, split, train_reference
from tests.tiny_lm import TinyLM, batches

GLOBAL_BATCH = 12
# ----------------------------------------------------------------------------- helpers run on ranks


def train_uniform(sharded: ShardedModel, model: TinyLM, optimizer, batch_sizes, n, steps, start=0, clip=None):
    """Micro-batch-major accumulation: same n on every rank, uneven sizes, loss weighted s/B."""
    rank, total = sharded.rank, sum(batch_sizes)
    lo = sum(batch_sizes[:rank])
    for x, y in batches(start + steps, total)[start:]:
        x, y = x[lo : lo + batch_sizes[rank]], y[lo : lo + batch_sizes[rank]]
        offset = 0
        sizes = split(batch_sizes[rank], n)
        for k, s in enumerate(sizes):
            sharded.set_requires_gradient_sync(k == len(sizes) - 1)
            loss = model.loss(model(x[offset : offset + s]), y[offset : offset + s]) * (s / total)
            sharded.backward(loss)
            offset += s
        if clip is not None:
            sharded.clip_grad_norm_(clip)
        optimizer.step()
        optimizer.zero_grad()


# ----------------------------------------------------------------------------- 3 ranks, one spawn

SHARE_CASES = [
    ([0.6, 0.3, 0.1], [6, 4, 2], 2, "padded"),
    ([0.7, 0.2, 0.1], [2, 3, 7], 3, "exact"),
    ([0.0005, 0.5, 0.4995], [4, 4, 4], 1, "padded"),  # a rank that stores almost nothing
    ([0.25, 0.0, 0.75], [5, 6, 1], 1, "exact"),  # and one that stores nothing at all
]
STEPS = 3


def _three_ranks(rank: int, world: int, ckpt_dir: str):
    out = {"cases": [], "logs": []}
    for shares, bs, n, mode in SHARE_CASES:
        model = TinyLM()
        sharded = ShardedModel(model, shares, collective=mode, record_collectives=True)
        optimizer = make_optimizer(model.parameters())
        train_uniform(sharded, model, optimizer, bs, n, STEPS)
        out["cases"].append(rank_pieces(sharded, optimizer))
        out["logs"].append(sharded.comm.log)
    # gradient clipping across uneven shards
    model = TinyLM()
    sharded = ShardedModel(model, [0.5, 0.2, 0.3])
    optimizer = make_optimizer(model.parameters())
    train_uniform(sharded, model, optimizer, [3, 5, 4], 1, STEPS, clip=0.05)
    out["clipped"] = rank_pieces(sharded, optimizer)
    # checkpoint after STEPS steps at shares [0.6, 0.3, 0.1]
    model = TinyLM()
    sharded = ShardedModel(model, [0.6, 0.3, 0.1])
    optimizer = make_optimizer(model.parameters())
    train_uniform(sharded, model, optimizer, [6, 4, 2], 1, STEPS)
    checkpoint.save(ckpt_dir, sharded, [optimizer], {"step": STEPS}, {})
    out["in_flight"] = {mode: _gather_in_flight(rank, mode) for mode in ("exact", "padded")}
    out["reducing"] = {mode: _reduce_scatter_peak(rank, mode) for mode in ("exact", "padded")}
    by_mode = {mode: ShardedModel(TinyLM(), [0.6, 0.3, 0.1], collective=mode) for mode in ("exact", "padded")}
    out["unpriced"] = {mode: sharded.in_flight_gather_bytes() for mode, sharded in by_mode.items()}
    out["unpriced_reduction"] = {mode: sharded.padded_reduction_bytes() for mode, sharded in by_mode.items()}
    out["padded_grads"] = _padded_gradient_layouts(by_mode["padded"])
    units = by_mode["exact"].units  # the same layout under either mode
    out["reduced"] = [(u.layout.max_shard, u.layout.numel) for u in units
                      if u.trainable and u.layout.numel and not u.layout.is_even]  # fp32 gradients
    out["uneven"] = [(u.layout.max_shard, u.compute_dtype.itemsize)
                     for u in units[1:] if u.layout.numel and not u.layout.is_even]
    return out


IN_FLIGHT_SHARES = [0.6, 0.3, 0.1]
IN_FLIGHT_NUMEL = 3000


def _gather_in_flight(rank: int, mode: str) -> tuple[int, bool]:
    """Bytes an asynchronous all-gather of an uneven unit allocates while in flight (beyond the
    unit's own buffer, allocated before), and whether every rank's shard arrived."""
    from cephalo_lightning.runtime.collectives import Collectives
    from cephalo_lightning.runtime.emulation.memory import MemoryTracker

    unit = build_layout([IN_FLIGHT_NUMEL], IN_FLIGHT_SHARES, ["unit"]).units[0]
    lo, hi = unit.shard_range(rank)
    out = torch.zeros(IN_FLIGHT_NUMEL)
    shard = torch.arange(lo, hi, dtype=torch.float32)
    with MemoryTracker() as tracker:
        pending = Collectives(None, mode).all_gather(shard, out, unit, async_op=True)
        held = tracker.current_bytes
        pending.wait()
    return held, torch.equal(out, torch.arange(IN_FLIGHT_NUMEL, dtype=torch.float32))


def _padded_gradient_layouts(sharded: ShardedModel) -> list[bool]:
    """Per uneven unit of ``sharded``: whether the gradient laid out padded at once equals the flat
    gradient cut into the ranks' ranges, each at the start of a row of ``max_shard`` elements."""
    gen = torch.Generator().manual_seed(5)
    same = []
    for unit in sharded.units:
        layout = unit.layout
        if not unit.trainable or not layout.numel or layout.is_even:
            continue
        grads = [torch.randn(p.shape, generator=gen) for p in unit.full_params]
        for param, grad in zip(unit.full_params, grads):
            param.grad = grad.clone()
        flat = unit.take_full_grad()
        for param, grad in zip(unit.full_params, grads):
            param.grad = grad.clone()
        padded = unit.take_full_grad(padded=True)
        want = torch.zeros(layout.world_size, layout.max_shard)
        for r, (a, b) in enumerate(zip(layout.bounds, layout.bounds[1:])):
            want[r, : b - a] = flat[a:b]
        same.append(torch.equal(padded, want.view(-1)) and all(p.grad is None for p in unit.full_params))
    return same


def _reduce_scatter_peak(rank: int, mode: str) -> tuple[int, bool]:
    """Peak bytes a reduce-scatter of an uneven unit allocates beside the unit's gradient (allocated
    before), and whether this rank's range is the sum of every rank's."""
    from cephalo_lightning.runtime.collectives import Collectives
    from cephalo_lightning.runtime.emulation.memory import MemoryTracker

    unit = build_layout([IN_FLIGHT_NUMEL], IN_FLIGHT_SHARES, ["unit"]).units[0]
    lo, hi = unit.shard_range(rank)
    full = torch.arange(IN_FLIGHT_NUMEL, dtype=torch.float32) * (rank + 1)
    with MemoryTracker() as tracker:
        shard = Collectives(None, mode).reduce_scatter(full, unit)
        peak = tracker.peak_bytes
    want = torch.arange(lo, hi, dtype=torch.float32) * sum(r + 1 for r in range(len(IN_FLIGHT_SHARES)))
    return peak, torch.equal(shard, want)


@pytest.fixture(scope="module")
def three_rank_run(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("ckpt") / "step3"
    results = run_distributed(_three_ranks, 3, str(ckpt))
    return results, ckpt


@pytest.mark.multiprocess
def test_uneven_shares_and_batches_match_single_process(three_rank_run):
    results, _ = three_rank_run
    want = reference_state(*train_reference(STEPS, GLOBAL_BATCH))
    for i, case in enumerate(SHARE_CASES):
        got = assemble([r["cases"][i] for r in results])
        assert_matches(got, want)


@pytest.mark.multiprocess
def test_every_rank_issues_the_same_collectives_in_the_same_order(three_rank_run):
    results, _ = three_rank_run
    for i in range(len(SHARE_CASES)):
        logs = [r["logs"][i] for r in results]
        assert logs[0] and all(log == logs[0] for log in logs[1:])


@pytest.mark.multiprocess
def test_an_exact_all_gather_in_flight_holds_no_buffer_beside_the_unit(three_rank_run):
    """A prefetched gather is in flight while the layer before it computes, beyond what the profile
    counts: the exact one holds nothing (an all_to_all_single held W copies of the shard); the
    padded one of an uneven unit holds its padded shard and W of them for staging, which the memory
    model does not price."""
    results, _ = three_rank_run
    chunk = build_layout([IN_FLIGHT_NUMEL], IN_FLIGHT_SHARES, ["unit"]).units[0].max_shard
    for r in results:
        assert r["in_flight"]["exact"] == (0, True)
        assert r["in_flight"]["padded"] == ((len(results) + 1) * chunk * 4, True)
    # what a sharded model reports for the check before a fit: the largest uneven unit's, padded only
    uneven = results[0]["uneven"]
    assert uneven, "the shares cut some unit unevenly"
    for r in results:
        assert r["unpriced"] == {"exact": 0, "padded": max((len(results) + 1) * m * size for m, size in uneven)}


@pytest.mark.multiprocess
def test_an_exact_reduce_scatter_holds_two_shards_however_uneven(three_rank_run):
    """Beside the unit's gradient, the exact reduce-scatter holds the buffer each peer's piece
    arrives in and the sum: two shards of this rank's size (the memory model's price per share),
    where an all_to_all_single held W + 1 of them. The padded one holds its W padded rows, on gloo
    W more received and their padded sum; the check before a fit adds up what of that the model
    does not price (the runtime lays the gradient out padded at once, so the flat one is not
    held beside it)."""
    results, _ = three_rank_run
    unit = build_layout([IN_FLIGHT_NUMEL], IN_FLIGHT_SHARES, ["unit"]).units[0]
    world = len(results)
    for rank, r in enumerate(results):
        lo, hi = unit.shard_range(rank)
        assert r["reducing"]["exact"] == (2 * (hi - lo) * 4, True)
        # the padded rows, the W received and their sum; the copy of this rank's range is taken when
        # they are freed, or while gloo's finished work still holds its receive buffer
        padded, held = (2 * world + 1) * unit.max_shard * 4, r["reducing"]["padded"]
        assert held[1] and padded <= held[0] <= padded + (hi - lo) * 4, (held, padded)
    for r in results:  # every uneven unit's gradient laid out padded at once, as the flat one padded
        assert r["padded_grads"] and all(r["padded_grads"]), r["padded_grads"]
    for r in results:  # beyond the flat gradient: the padding, on gloo W padded rows received, the padded sum
        assert r["unpriced_reduction"] == {"exact": 0, "padded": max(((2 * world + 1) * m - n) * 4 for m, n in r["reduced"])}


@pytest.mark.multiprocess
def test_near_zero_share_rank_stores_almost_nothing_and_still_trains(three_rank_run):
    results, _ = three_rank_run
    case = SHARE_CASES.index(([0.0005, 0.5, 0.4995], [4, 4, 4], 1, "padded"))
    owned = [sum(v.numel() for k, (_, v) in r["cases"][case].items() if "exp_avg" not in k) for r in results]
    assert 0 < owned[0] < 0.002 * sum(owned)
    empty = SHARE_CASES.index(([0.25, 0.0, 0.75], [5, 6, 1], 1, "exact"))
    assert sum(v.numel() for _, v in results[1]["cases"][empty].values()) == 0


@pytest.mark.multiprocess
def test_global_norm_clipping_across_uneven_shards(three_rank_run):
    results, _ = three_rank_run
    want = reference_state(*train_reference(STEPS, GLOBAL_BATCH, clip=0.05))
    assert_matches(assemble([r["clipped"] for r in results]), want)


# ----------------------------------------------------------------------------- 2 and 4 ranks, random shares


def random_case(world: int, seed: int) -> tuple[list[float], list[int]]:
    """Random shares (one of them near zero) and random batch sizes >= 2 summing to GLOBAL_BATCH."""
    rng = random.Random(seed)
    shares = [rng.random() + 0.05 for _ in range(world)]
    shares[rng.randrange(world)] = 1e-4
    cuts = sorted(rng.sample(range(1, GLOBAL_BATCH // 2), world - 1))
    sizes = [2 * (b - a) for a, b in zip([0, *cuts], [*cuts, GLOBAL_BATCH // 2])]
    return [x / sum(shares) for x in shares], sizes


def _random_shares(world: int):
    out = []
    for seed, mode in ((1, "padded"), (2, "exact")):
        shares, sizes = random_case(world, seed)
        model = TinyLM()
        sharded = ShardedModel(model, shares, collective=mode)
        optimizer = make_optimizer(model.parameters())
        train_uniform(sharded, model, optimizer, sizes, 2, STEPS)
        out.append(rank_pieces(sharded, optimizer))
    return out


# ----------------------------------------------------------------------------- checkpoint resharding


def _resume(ckpt_dir: str, shares: list[float], batch_sizes: list[int]):
    model = TinyLM(seed=123)  # different init: everything must come from the checkpoint
    sharded = ShardedModel(model, shares)
    optimizer = make_optimizer(model.parameters())
    meta, _ = checkpoint.load(ckpt_dir, sharded, [optimizer])
    assert meta["step"] == STEPS
    train_uniform(sharded, model, optimizer, batch_sizes, 1, 2, start=STEPS)
    return rank_pieces(sharded, optimizer)


RESHARD = {2: ([0.25, 0.75], [9, 3]), 4: ([0.25, 0.25, 0.25, 0.25], [3, 3, 3, 3])}  # world -> shares, batch sizes


def _random_shares_and_resume(rank: int, world: int, ckpt_dir: str):
    """Both scenarios of this world size in one spawn: random shares, then the resharded resume."""
    return {"random": _random_shares(world), "resumed": _resume(ckpt_dir, *RESHARD[world])}


@pytest.fixture(scope="module")
def two_and_four(three_rank_run):
    _, ckpt = three_rank_run
    return {world: run_distributed(_random_shares_and_resume, world, str(ckpt)) for world in RESHARD}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_random_uneven_shares_match_single_process(two_and_four, world):
    results = [r["random"] for r in two_and_four[world]]
    want = reference_state(*train_reference(STEPS, GLOBAL_BATCH))
    for case in range(2):
        assert_matches(assemble([r[case] for r in results]), want)


def _continued_reference():
    model, optimizer = train_reference(STEPS, GLOBAL_BATCH)
    return reference_state(*train_reference(2, GLOBAL_BATCH, start=STEPS, model=model, optimizer=optimizer))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "shares,batch_sizes", [([0.25, 0.75], [9, 3]), ([0.25, 0.25, 0.25, 0.25], [3, 3, 3, 3])], ids=["2-ranks", "4-even"]
)
def test_checkpoint_reshards_to_another_world_size(two_and_four, shares, batch_sizes):
    assert RESHARD[len(shares)] == (shares, batch_sizes)
    results = [r["resumed"] for r in two_and_four[len(shares)]]
    assert_matches(assemble(results), _continued_reference())


def _on_a_subgroup(rank: int, world: int, ckpt_dir: str):
    """Ranks 1 and 2 hold the model on a subgroup, save at one layout and resume at another;
    rank 0 takes part in none of it (its group's first rank is world rank 1)."""
    group = torch.distributed.new_group([1, 2])
    out = None
    if rank in (1, 2):
        model = TinyLM()
        sharded = ShardedModel(model, [0.7, 0.3], group=group)
        optimizer = make_optimizer(model.parameters())
        train_uniform(sharded, model, optimizer, [9, 3], 1, STEPS)
        checkpoint.save(ckpt_dir, sharded, [optimizer], {"step": STEPS}, {})
        model = TinyLM(seed=123)
        sharded = ShardedModel(model, [0.4, 0.6], group=group)
        optimizer = make_optimizer(model.parameters())
        meta, _ = checkpoint.load(ckpt_dir, sharded, [optimizer])
        assert meta["step"] == STEPS
        train_uniform(sharded, model, optimizer, [5, 7], 1, 2, start=STEPS)
        out = rank_pieces(sharded, optimizer)
    torch.distributed.barrier()  # the world meets only after the subgroup is done
    return out


@pytest.mark.multiprocess
def test_a_model_on_a_subgroup_checkpoints_over_its_own_group(tmp_path):
    ckpt = tmp_path / "subgroup"
    results = run_distributed(_on_a_subgroup, 3, str(ckpt))
    assert results[0] is None
    assert_matches(assemble(results[1:]), _continued_reference())
    checkpoint.verify(ckpt)


@pytest.mark.multiprocess
def test_checkpoint_loads_into_a_plain_model_without_process_group(three_rank_run):
    _, ckpt = three_rank_run
    model, _ = train_reference(STEPS, GLOBAL_BATCH)
    plain = TinyLM(seed=99)
    plain.load_state_dict(checkpoint.load_full_state_dict(ckpt))
    for (name, got), want in zip(plain.named_parameters(), model.parameters()):
        assert torch.allclose(got, want, atol=TOL), name


def test_checkpoint_directory_is_published_atomically(tmp_path):
    model = TinyLM()
    sharded = ShardedModel(model, [1.0])
    target = tmp_path / "ckpt"
    checkpoint.save(target, sharded, [], {"step": 1}, {})
    first = checkpoint.read_meta(target)
    assert first["step"] == 1 and not list(tmp_path.glob(".ckpt.*"))
    checkpoint.save(target, sharded, [], {"step": 2}, {})  # overwrite: old one replaced whole
    assert checkpoint.read_meta(target)["step"] == 2 and not list(tmp_path.glob(".ckpt.*"))
    # a save that dies before publishing leaves only a staging directory, never a checkpoint
    staging = tmp_path / ".other.staging-dead"
    staging.mkdir()
    assert not checkpoint.is_checkpoint(tmp_path / "other")


# ----------------------------------------------------------------------------- single process


def test_bf16_compute_keeps_fp32_master_and_tracks_fp32_training():
    x, y = batches(1, 8)[0]
    ref_model, ref_opt = train_reference(1, 8)
    model = TinyLM()
    sharded = ShardedModel(model, [1.0], compute_dtype=torch.bfloat16)
    assert all(u.master.dtype == torch.float32 for u in sharded.units)
    with torch.no_grad(), sharded.summon_full_params():
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        bf16_loss = model.loss(model(x), y).item()
    assert abs(bf16_loss - TinyLM().loss(TinyLM()(x), y).item()) < 0.05
    optimizer = make_optimizer(model.parameters())
    train_uniform(sharded, model, optimizer, [8], 1, 1)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # local pieces: fp32 master
    got = sharded.full_state_dict()
    for name, want in ref_model.named_parameters():
        assert (got[name] - want).abs().max().item() < 2e-2, name


class _RegionRecorder(Observer):
    """Every compute region and collective, with how many regions are open."""

    def __init__(self) -> None:
        self.depth = 0
        self.events: list[tuple[str, str, int]] = []

    def compute_begin(self, region: str) -> None:
        self.depth += 1
        self.events.append(("begin", region, self.depth))

    def compute_end(self, region: str) -> None:
        self.depth -= 1
        self.events.append(("end", region, self.depth))

    def collective_begin(self, op: str, unit: str, numel: int) -> None:
        self.events.append(("collective", op, self.depth))


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the embedding's input needs no gradient
def test_the_uniform_roots_compute_is_a_region_and_no_collective_runs_inside_one():
    """The root unit's own forward (embedding, head) and backward run inside a compute region (an
    emulator slows them, busy time counts them), one region at a time, and every collective outside;
    between the units' backward (autograd's host work) no region is open."""
    model = TinyLM()
    sharded = ShardedModel(model, [1.0])
    recorder = sharded.observers.attach(_RegionRecorder())
    seen: list[tuple[str, int]] = []
    for name in ("embed", "head"):
        getattr(model, name).register_forward_hook(lambda *_, name=name: seen.append((name, recorder.depth)))
        getattr(model, name).register_full_backward_pre_hook(
            lambda *_, name=name: seen.append((f"{name} backward", recorder.depth)))
    (x, y), = batches(1, 4)
    logits = model(x)
    sharded.backward(model.loss(logits, y))
    assert sorted(seen) == [("embed", 1), ("embed backward", 1), ("head", 1), ("head backward", 1)]
    assert recorder.depth == 0 and max(depth for *_, depth in recorder.events) == 1  # never nested
    assert [e for e in recorder.events if e[0] == "collective"] and all(
        depth == 0 for kind, _, depth in recorder.events if kind == "collective")
    begun = [region for kind, region, _ in recorder.events if kind == "begin"]
    assert set(begun) == {"root_compute", "unit_forward", "unit_backward"}
    backward = [i for i, region in enumerate(begun) if region == "unit_backward"]
    assert len(backward) == len(model.blocks) and set(begun[backward[0]:backward[-1] + 1]) == {"unit_backward"}


def test_layout_quotas_are_exact_and_even_units_come_first():
    rng = random.Random(0)
    for _ in range(50):
        world = rng.randint(1, 5)
        shares = [rng.random() ** 3 for _ in range(world)]
        sizes = [rng.randint(0, 300) for _ in range(rng.randint(1, 12))]
        layout = build_layout(sizes, shares)
        want = quotas(shares, sum(sizes))
        assert [layout.owned_numel(r) for r in range(world)] == want
        for unit, size in zip(layout.units, sizes):
            assert unit.numel == size and list(unit.bounds) == sorted(unit.bounds)
        # once a unit is uneven because a rank ran out, no later unit gives that rank anything back
        exhausted: set[int] = set()
        for unit in layout.units:
            assert all(unit.shard_sizes[r] == 0 for r in exhausted)
            exhausted |= {r for r in range(world) if sum(u.shard_sizes[r] for u in layout.units[: layout.units.index(unit) + 1]) == want[r]}


def test_layout_is_inspectable_and_every_element_has_one_owner():
    model = TinyLM()
    sharded = ShardedModel(model, [1.0])
    layout = build_layout([u.layout.numel for u in sharded.units], [0.7, 0.2, 0.1],
                          [u.layout.name for u in sharded.units], [u.layout.params for u in sharded.units])
    owned: dict[str, int] = {}
    for name, rank, start, stop in layout.owners():
        owned[name] = owned.get(name, 0) + stop - start
    assert owned == {name: p.numel() for name, p in TinyLM().named_parameters()}
    table = layout.describe()
    assert "blocks.0" in table and "total" in table


def test_wrap_policy_errors_name_the_problem_and_the_fix():
    flat = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(WrapPolicyError, match="units=\\[YourBlockClass\\]"):
        find_units(flat)
    with pytest.raises(WrapPolicyError, match="no submodule is one of"):
        find_units(TinyLM(), [torch.nn.Conv2d])
    with pytest.raises(WrapPolicyError, match="units overlap"):
        model = TinyLM()
        ShardedModel(model, [1.0], units=[[model.blocks[0]], [model.blocks[0].up]])
    with pytest.raises(ValueError, match="one share per rank"):
        ShardedModel(TinyLM(), [0.5, 0.5])


def _meta_tied_with_head_bias(head_in_root: bool) -> dict[str, torch.Tensor]:
    """TinyLM with ``head.weight`` tied to the embedding and a head bias, built on meta and
    initialised unit by unit (the head a unit of its own, or part of the root)."""
    from cephalo_lightning.models import _torch_init
    from cephalo_lightning.runtime.sharding.sharded_model import UnitMaterializer

    with torch.device("meta"):
        model = TinyLM(vocab=40, dim=16)
        model.head = torch.nn.Linear(16, 40, bias=True)
        model.head.weight = model.embed.weight
    units = [model.embed, *model.blocks, model.norm] + ([] if head_in_root else [model.head])
    sharded = ShardedModel(model, [1.0], units=units,
                           materializer=UnitMaterializer(torch.device("cpu"), init=_torch_init, seed=3))
    return sharded.full_state_dict()


def test_meta_init_leaves_a_tied_weight_to_its_canonical_holder():
    # nn.Embedding initialises N(0, 1); the head's Linear init would write U(-1/4, 1/4) into the
    # embedding it shares, if a unit's init could reach parameters that are not its own
    apart, together = _meta_tied_with_head_bias(False), _meta_tied_with_head_bias(True)
    for state in (apart, together):
        assert state["embed.weight"].std() > 0.8, state["embed.weight"].std()
        assert 0 < state["head.bias"].abs().max() <= 0.25  # the head's own init ran (bound 1/sqrt(16))


def test_padded_collective_buffers_beyond_the_plans_room_are_named_before_the_fit():
    from cephalo_lightning.lightning.fit.fit_runtime import unpriced_buffers

    assert unpriced_buffers([(0, 0, 1e6), (1, 2**20, 2**21), (2, 2**20, None)]) is None  # within room, or unknown
    warning = unpriced_buffers([(0, 3 * 2**20, 2**20), (1, 2**20, 2**21), (2, 2**20, -5.0)])
    assert warning is not None and "collective='exact'" in warning
    assert "rank 0: 3.0 MiB against 1.0 MiB" in warning and "rank 2: 1.0 MiB against 0.0 MiB" in warning
    assert "rank 1" not in warning
