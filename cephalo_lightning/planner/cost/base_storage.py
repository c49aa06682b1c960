"""What a frozen parameter costs under each way of storing the base (torch-free).

A frozen parameter holds only its stored weight (:class:`~cephalo_lightning.planner.schema.cluster_spec.ModelSpec`'s
``weight_bytes_per_param``); the storage kind (:class:`~cephalo_lightning._common.vocabulary.BaseStorage`)
and the compute dtype's size ``c`` set it::

    compute:  c                                  (4 under fp32 training, 2 under bf16 / fp16)
    nf4:      q x (1/2 + 4 / B) + (1 - q) x c    (q: the quantised fraction of the frozen parameters;
                                                  a 4-bit code and one fp32 scale per block of B: 0.5625 at B = 64)

An fp32 master copy of the base (what LoRA stored before the base followed the compute dtype) is
``compute`` at ``c = 4``. NF4 quantises every frozen matrix (the blocks' linear weights, the embedding and the head alike;
bitsandbytes' ``Linear4bit`` leaves the last two in bf16, here they are matrices like the others);
the vectors (norms, biases) stay in the compute dtype, so the mean over the frozen parameters needs
the fraction in matrices (``llama_matrix_fraction`` for a Llama-shaped model: all but its norms).

[Note: a gathered NF4 unit] An NF4 unit's all-gather moves its 4-bit bytes and scales
(``ModelSpec.gathered_bytes_per_param`` prices a frozen parameter's gather at its stored bytes where
they are fewer than the compute dtype's); each rank then dequantises the gathered unit into the
compute dtype for the unit's forward and backward, so the gathered unit's working memory is still
``compute_bytes_per_param`` a parameter (plus the gathered 4-bit copy, freed with it).
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


def llama_matrix_fraction(parameters: int, num_layers: int, hidden_size: int) -> float:
    """The fraction of a Llama-shaped model's parameters in matrices: all but its RMS norms (two a
    layer and the final one, ``hidden_size`` each; a Llama has no biases)."""
    vectors = (2 * num_layers + 1) * hidden_size
    if not 0 <= vectors < parameters:
        raise PlanningError(f"{num_layers} layers of norms at hidden size {hidden_size:,} do not fit in "
                            f"{parameters:,} parameters")
    return (parameters - vectors) / parameters
