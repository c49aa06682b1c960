"""QLoRA on 2 gloo ranks: the frozen matrices stored as NF4 blocks, trained like the same quantised model.

A TinyLM (dim 16) with its matrices frozen and its norms and biases trained (the adapters' stand-in),
sharded 0.7 / 0.3 with ``base=nf4``, computing in fp32 (exact and padded collectives) and in bf16. The reference is single-process training
(:func:`tests.reference.train_steps`) of the same quantised model: every frozen matrix set to the
ranks' stored NF4 bytes and scales, decoded by hand with the published NF4 code book (not by the code
under test), on the global batch. Fails on a block dequantised with another block's scale (the
gathered weights then differ from the hand decode) and on a base that moved (its bytes, scales or
gathered values change over training). A checkpoint resumed into a model of other weights stores the
same bytes again and ends bitwise where the uninterrupted run does.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

pytest.importorskip("bitsandbytes")

from cephalo_lightning._common.vocabulary import BaseStorage  # noqa: E402
from cephalo_lightning.runtime import checkpoint  # noqa: E402
from cephalo_lightning.runtime.sharding.sharded_model import ShardedModel  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.reference import make_optimizer, train_steps  # noqa: E402
from tests.tiny_lm import TinyLM, batches  # noqa: E402

STEPS = 3
SHARES = [0.7, 0.3]
BATCHES = [5, 3]
FLOOR = 10  # x the measured floor (the reference with the ranks' pieces summed in the other order)
FLOOR_EPS = 1e-7
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])


def model(seed: int = 0) -> TinyLM:
    m = TinyLM(dim=16, seed=seed)
    for name, p in m.named_parameters():
        p.requires_grad_(p.dim() < 2)  # the matrices frozen (the base), norms and biases trained
    return m


def stored(sharded: ShardedModel) -> dict[str, list]:
    """Every frozen matrix piece this rank stores: (name, element range, codes, scales)."""
    out = {}
    for unit in sharded.units:
        s = unit.frozen
        if s is None:
            continue
        block = 0
        for span in s.layout.params:
            if len(span.shape) < 2:
                continue
            a, b = s.layout.param_piece(span, s.rank)
            n = -(-(b - a) // s.blocksize)
            if b > a:  # sliced by hand: 32 code bytes and one scale a block of 64
                out[span.name] = (a, b, s.blocks.codes[block * 32:(block + n) * 32].clone(),
                                  s.blocks.absmax[block:block + n].clone())
            block += n
    return out


def train(sharded: ShardedModel, m: TinyLM, optimizer, rank: int, steps: range) -> None:
    lo = sum(BATCHES[:rank])
    for x, y in batches(steps.stop, sum(BATCHES))[steps.start:]:
        x, y = x[lo:lo + BATCHES[rank]], y[lo:lo + BATCHES[rank]]
        sharded.backward(m.loss(m(x), y) * (BATCHES[rank] / sum(BATCHES)))
        optimizer.step()
        optimizer.zero_grad()


def _ranks(rank: int, world: int, root: str):
    m = model()
    sharded = ShardedModel(m, SHARES, base=BaseStorage.NF4)
    before = stored(sharded)
    optimizer = make_optimizer([p for p in m.parameters() if p.requires_grad])
    train(sharded, m, optimizer, rank, range(0, STEPS - 1))
    checkpoint.save(root, sharded, [optimizer], {"step": STEPS - 1}, {})
    train(sharded, m, optimizer, rank, range(STEPS - 1, STEPS))
    out = {"before": before, "after": stored(sharded), "state": sharded.full_state_dict(),
           "bytes": sharded.local_state_bytes(),
           "meta": sorted(n for n, p in sharded.named_parameters() if p.is_meta)}
    # resume into a model built from another seed: the base and the adapters come from the checkpoint
    m2 = model(seed=1)
    resumed = ShardedModel(m2, SHARES, base=BaseStorage.NF4)
    optimizer2 = make_optimizer([p for p in m2.parameters() if p.requires_grad])
    checkpoint.load(root, resumed, [optimizer2])
    out["reloaded"] = stored(resumed)
    train(resumed, m2, optimizer2, rank, range(STEPS - 1, STEPS))
    out["resumed"] = resumed.full_state_dict()
    # bf16 compute: the base dequantised into bf16 for each unit, the adapters' fp32 masters cast to bf16
    m3 = model()
    bf16 = ShardedModel(m3, SHARES, base=BaseStorage.NF4, compute_dtype=torch.bfloat16)
    out["bf16 before"] = stored(bf16)
    train(bf16, m3, make_optimizer([p for p in m3.parameters() if p.requires_grad]), rank, range(0, STEPS))
    out["bf16"] = bf16.full_state_dict()
    # padded collectives (NCCL's): the 4-bit bytes and scales gathered through equal-size chunks
    m4 = model()
    padded = ShardedModel(m4, SHARES, base=BaseStorage.NF4, collective="padded")
    train(padded, m4, make_optimizer([p for p in m4.parameters() if p.requires_grad]), rank, range(0, STEPS))
    out["padded"] = padded.full_state_dict()
    return out


def by_hand(codes: torch.Tensor, absmax: torch.Tensor, blocksize: int, numel: int) -> torch.Tensor:
    nibbles = torch.stack([codes >> 4, codes & 15], dim=1).reshape(-1).long()
    return (NF4[nibbles] * absmax.repeat_interleave(blocksize))[:numel]


def quantised_base(runs, key: str = "before") -> dict[str, torch.Tensor]:
    """Every frozen matrix as the ranks store it, decoded by hand, put together from their pieces."""
    base = dict(model().named_parameters())
    out = {}
    for name, p in base.items():
        if p.dim() < 2:
            continue
        flat = torch.empty(p.numel())
        for r in runs:
            if name in r[key]:
                a, b, codes, absmax = r[key][name]
                flat[a:b] = by_hand(codes, absmax, 64, b - a)
        out[name] = flat.view(p.shape)
    return out


def reference(weights: dict[str, torch.Tensor], reverse: bool = False,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Single-process training of the quantised model on the global batch, computing in ``dtype``
    (the base's hand-decoded weights cast to it, the trainable fp32 masters cast to it for the forward)."""
    m = model()
    trained = {n: p for n, p in m.named_parameters() if p.requires_grad}

    def loss_of(batch):
        params = {**{n: w.to(dtype) for n, w in weights.items()}, **{n: p.to(dtype) for n, p in trained.items()}}
        return m.loss(functional_call(m, params, (batch[0],)), batch[1])

    steps = []
    for x, y in batches(STEPS, sum(BATCHES)):
        starts = [0, BATCHES[0]]
        ranks = [[((x[s:s + n], y[s:s + n]), n / sum(BATCHES))] for s, n in zip(starts, BATCHES)]
        steps.append(ranks[::-1] if reverse else ranks)
    train_steps(make_optimizer(list(trained.values())), loss_of, steps, per_rank=True)
    return {n: p.detach() for n, p in trained.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_distributed(_ranks, 2, str(tmp_path_factory.mktemp("qlora")))


@pytest.mark.multiprocess
def test_qlora_trains_like_the_same_quantised_model_in_one_process(runs) -> None:
    weights = quantised_base(runs)
    want, other = reference(weights), reference(weights, reverse=True)
    floor = max((want[k] - other[k]).abs().max().item() for k in want)
    bound = FLOOR * max(floor, FLOOR_EPS)
    for r in runs:
        for run in ("state", "padded"):
            err = max((r[run][k] - v).abs().max().item() for k, v in want.items())
            assert err <= bound, (run, err, bound)
            assert all(torch.equal(r[run][name], w) for name, w in weights.items()), run
        # the gathered base is the hand decode of the stored bytes: every block with its own scale
        for name, w in weights.items():
            assert torch.equal(r["state"][name], w), name


@pytest.mark.multiprocess
def test_qlora_computing_in_bf16_trains_like_the_same_quantised_model_in_bf16(runs) -> None:
    """The same with bf16 compute: the bound is 10x the bf16 floor (the reference with the ranks'
    pieces summed in the other order)."""
    weights = quantised_base(runs, key="bf16 before")
    want, other = reference(weights, dtype=torch.bfloat16), reference(weights, reverse=True, dtype=torch.bfloat16)
    floor = max((want[k] - other[k]).abs().max().item() for k in want)
    bound = FLOOR * max(floor, FLOOR_EPS)
    for r in runs:
        err = max((r["bf16"][k] - v).abs().max().item() for k, v in want.items())
        print(f"bf16: largest difference {err:.2e}, floor {floor:.2e}, bound {bound:.2e}")
        assert err <= bound, (err, bound)
        for name, w in weights.items():  # the base: the hand decode of the bytes (fp32 values, exact)
            assert torch.equal(r["bf16"][name], w), name


@pytest.mark.multiprocess
def test_the_quantised_base_stays_bitwise_frozen(runs) -> None:
    for r in runs:
        assert r["before"].keys() == r["after"].keys() and r["before"]
        for name, (a, b, codes, absmax) in r["before"].items():
            a2, b2, codes2, absmax2 = r["after"][name]
            assert (a, b) == (a2, b2) and torch.equal(codes, codes2) and torch.equal(absmax, absmax2), name


@pytest.mark.multiprocess
def test_a_rank_stores_its_nf4_pieces_and_no_copy_of_them(runs) -> None:
    """The frozen part's stored bytes are the 4-bit codes, their fp32 scales and the frozen vectors
    (none here: every vector trains); the modules hold each quantised piece on the meta device."""
    for r in runs:
        _, frozen_bytes = r["bytes"]
        codes = sum(c.numel() + 4 * s.numel() for _, _, c, s in r["before"].values())
        elements = sum(b - a for a, b, _, _ in r["before"].values())
        assert codes == frozen_bytes
        assert codes <= 0.5 * elements + 4 * elements / 64 + 36 * len(r["before"])  # a padded block a piece at most
        assert r["meta"] == sorted(n for n, p in model().named_parameters() if p.dim() >= 2)


@pytest.mark.multiprocess
def test_a_qlora_run_resumes_exactly(runs) -> None:
    for r in runs:
        for name, (a, b, codes, absmax) in r["before"].items():  # the same bytes, from the checkpoint's values
            a2, b2, codes2, absmax2 = r["reloaded"][name]
            assert (a, b) == (a2, b2) and torch.equal(codes, codes2) and torch.equal(absmax, absmax2), name
        for name, value in r["state"].items():
            assert torch.equal(r["resumed"][name], value), name
