"""What a frozen parameter costs under each way of storing the base (torch-free).

A frozen parameter holds only its stored weight (:class:`~cephalo_lightning.planner.schema.cluster_spec.ModelSpec`'s
``weight_bytes_per_param``); the storage kind (:class:`~cephalo_lightning._common.vocabulary.BaseStorage`)
and the compute dtype's size ``c`` set it::

    compute:  c                                  (4 under fp32 training, 2 under bf16 / fp16)
    nf4:      q x (1/2 + 4 / B) + (1 - q) x c    (q: the quantised fraction of the frozen parameters;
                                                  a 4-bit code and one fp32 scale per block of B: 0.5625 at B = 64)

An fp32 master copy of the base (what LoRA stored before the base followed the compute dtype) is
``compute`` at ``c = 4``. NF4 quantises the frozen matrices (QLoRA's choice, and bitsandbytes'); embeddings,
norms and biases stay in the compute dtype, so the mean over the frozen parameters needs the
fraction that is quantised. For a Llama-shaped model the linear weights of the decoder blocks are
all but the embedding and the head (``linear_fraction``).

[Note: a gathered NF4 unit] An NF4 unit's all-gather moves its 4-bit bytes and scales; each rank then
dequantises the gathered unit into the compute dtype for the unit's forward and backward, so the
gathered unit's working memory is still ``compute_bytes_per_param`` a parameter (plus the gathered
4-bit copy, freed with it). The cost model prices the gather at ``compute_bytes_per_param``, an upper
bound for an NF4 unit (the bytes moved are about a quarter of it): a plan never runs slower for it.
"""

from __future__ import annotations

from cephalo_lightning._common.vocabulary import BaseStorage
from cephalo_lightning.planner.schema.planning_error import PlanningError

NF4_BLOCKSIZE = 64


def nf4_bytes_per_param(blocksize: int = NF4_BLOCKSIZE) -> float:
    """One NF4-quantised parameter: half a byte of code and its share of its block's fp32 scale."""
    if blocksize <= 0 or blocksize % 2:
        raise PlanningError(f"NF4 blocksize {blocksize!r} must be a positive even number of elements (64 is QLoRA's)")
    return 0.5 + 4.0 / blocksize


def weight_bytes_per_param(storage: BaseStorage, compute_bytes: float = 2.0, quantised_fraction: float = 1.0,
                           blocksize: int = NF4_BLOCKSIZE) -> float:
    """The mean stored bytes of a frozen parameter (``model.weight_bytes_per_param``) for ``storage``
    under a compute dtype of ``compute_bytes``; for NF4, ``quantised_fraction`` of the frozen
    parameters are quantised, the rest kept in the compute dtype."""
    storage = BaseStorage(storage)
    if compute_bytes not in (2.0, 4.0):
        raise PlanningError(f"a compute dtype of {compute_bytes!r} bytes: use 2 (bf16 / fp16) or 4 (fp32)")
    if storage is BaseStorage.COMPUTE:
        return float(compute_bytes)
    if not 0.0 <= quantised_fraction <= 1.0:
        raise PlanningError(f"the quantised fraction {quantised_fraction!r} of the frozen parameters must be between "
                            "0 and 1")
    return quantised_fraction * nf4_bytes_per_param(blocksize) + (1.0 - quantised_fraction) * compute_bytes


def llama_linear_fraction(parameters: int, vocab_size: int, hidden_size: int, tied: bool = False) -> float:
    """The fraction of a Llama-shaped model's parameters in its decoder blocks' linear layers: all but
    the embedding and the head (one matrix if ``tied``; the norms are a rounding error)."""
    outside = vocab_size * hidden_size * (1 if tied else 2)
    if not 0 < outside < parameters:
        raise PlanningError(f"a vocabulary of {vocab_size:,} at hidden size {hidden_size:,} does not fit in "
                            f"{parameters:,} parameters")
    return (parameters - outside) / parameters
