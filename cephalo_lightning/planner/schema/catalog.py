"""Built-in catalog of common GPUs, for what-if planning before anything is measured.

A device entry in a cluster file with only a ``name`` (no measured arrays) is estimated here from
public datasheet figures (design brief, "Public device figures") and the model's shape. The
estimate is deliberately simple and documented, so a plan made from it can be judged:

* forward FLOPs of one transformer layer for one sample of ``s`` tokens, hidden size ``h``
  (Megatron-LM accounting: QKV, projection and 4h MLP matmuls, then scores and values)::

      flops_fwd = 24 * s * h**2 + 4 * s**2 * h

* forward time of a micro-batch of ``m`` samples, at the model FLOP utilisation
  ``settings.estimated_mfu`` of the card's peak ``peak_tflops``, plus a fixed launch overhead::

      layer_fwd_ms(m) = m * flops_fwd / (peak_tflops * 1e12 * mfu) * 1e3 + LAUNCH_OVERHEAD_MS
      layer_bwd_ms(m) = 2 * layer_fwd_ms(m)                        # two matmuls per forward one

* compute memory (everything but the sharded training state) of the layered schedule: a fixed
  workspace, one gathered layer's parameters (``compute_bytes_per_param``, bf16) and its unsharded
  fp32 gradient, and one micro-batch's activations of one layer (Korthikanti et al. 2022, 16-bit
  activations without recomputation, ``a = h / HEAD_DIM`` heads)::

      compute_memory_gb(m) = WORKSPACE_GB
                             + layer_params * (compute_bytes_per_param + 4) / 2**30
                             + m * (34 * s * h + 5 * a * s**2) / 2**30

  The stashed layer inputs of the layered schedule are assumed offloaded to host memory (as the
  runtime does on CUDA), so they do not count.

``peak_tflops`` is the throughput of the precision mixed-precision training runs in: dense (no
structured sparsity) bf16 tensor math with fp32 accumulate, fp16 where the card has no bf16 (V100,
T4: fp16 inputs, fp32 accumulate, at full rate), fp32 where it has no tensor cores (P40). The
accumulate matters on GeForce cards: they run fp32 accumulate at half their fp16-accumulate rate
(NVIDIA's GA102 and Ada whitepapers: RTX 3090 71 against 142, RTX 4090 165 against 330), which is
the rate ``torch.autocast`` gets; data-center and professional cards (A100, H100, H200, L4, L40S,
RTX A6000, and V100 and T4 in fp16) run it at full rate; the A10G's peak is unpublished (AWS's
part). A card's figure is its SMs x its tensor FMAs per SM per clock x 2 x its boost clock, which
``tests/planner/test_planner_catalog.py`` checks against the datasheets.

Memory figures are GiB as ``torch.cuda`` reports a card's total memory (slightly under the
datasheet's GB on most cards). Estimates are labelled ``source="catalog"`` everywhere downstream.
"""

from __future__ import annotations

from dataclasses import dataclass

from cephalo_lightning._common.units import GIB
from cephalo_lightning._common.vocabulary import ProfileSource
from cephalo_lightning.planner.schema.cluster_spec import DeviceProfile, ModelSpec, Settings
from cephalo_lightning.planner.schema.gpu_names import identify, same_device
from cephalo_lightning.planner.schema.planning_error import PlanningError

PROFILE_SIZES = 8  # micro-batch sizes 1..8 are estimated; the cost model extrapolates beyond
LAUNCH_OVERHEAD_MS = 0.1  # per layer forward: ~20 kernel launches of ~5 us
WORKSPACE_GB = 0.25  # cuBLAS/cuDNN workspaces and allocator slack beyond the reserved memory
HEAD_DIM = 64  # a = h / 64 heads: conservative (more heads -> larger attention scores)


@dataclass(frozen=True)
class GpuSpec:
    """Datasheet figures of one GPU model."""

    key: str  # canonical catalog name
    memory_gb: float  # GiB as torch.cuda reports it
    tflops: float  # dense bf16 tensor peak, fp32 accumulate (fp16 without bf16; fp32 without tensor cores)
    memory_bandwidth_gbps: float
    aliases: tuple[str, ...] = ()
    note: str = ""


CATALOG: tuple[GpuSpec, ...] = (
    GpuSpec("v100-16gb", 15.8, 125, 900, ("v100", "v100sxm2", "v10016"),
            "fp16 (no bf16), fp32 accumulate at full rate; SXM2 (PCIe: 112)"),
    GpuSpec("v100-32gb", 31.7, 125, 900, ("v10032",), "fp16 (no bf16), fp32 accumulate at full rate; SXM2"),
    GpuSpec("t4", 14.6, 65, 320, ("t416",), "fp16 (no bf16), fp32 accumulate at full rate"),
    GpuSpec("a10g", 22.0, 70, 600, ("a10g24",), "bf16, fp32 accumulate; peak unpublished; ~55 achieved"),
    GpuSpec("l4", 22.0, 121, 300, ("l424",), "bf16, fp32 accumulate at full rate"),
    GpuSpec("rtx3090", 24.0, 71, 936, ("3090", "rtx309024"), "bf16, fp32 accumulate: half the fp16-accumulate 142"),
    GpuSpec("rtx4090", 24.0, 165, 1008, ("4090", "rtx409024"), "bf16, fp32 accumulate: half the fp16-accumulate 330"),
    GpuSpec("a6000", 47.5, 155, 768, ("rtxa6000", "a600048"), "bf16, fp32 accumulate at full rate"),
    GpuSpec("l40s", 44.5, 362, 864, ("l40s48",), "bf16, fp32 accumulate at full rate"),
    GpuSpec("a100-40gb", 39.4, 312, 1555, ("a100", "a10040"), "bf16, fp32 accumulate at full rate"),
    GpuSpec("a100-80gb", 79.2, 312, 2039, ("a10080",), "bf16, fp32 accumulate at full rate"),
    GpuSpec("h100", 79.1, 989, 3350, ("h10080",), "bf16, fp32 accumulate at full rate; SXM (PCIe: 756)"),
    GpuSpec("h200", 139.8, 989, 4800, ("h200141",), "bf16, fp32 accumulate at full rate"),
    GpuSpec("p40", 22.4, 12, 346, ("p4024",), "no tensor cores: fp32 peak"),
)

def known_names() -> list[str]:
    return [spec.key for spec in CATALOG]


def lookup(name: str, memory_gb: float | None = None) -> GpuSpec | None:
    """The catalog entry for a GPU name as a person or CUDA writes it ("A100-80GB", "a100_80g",
    "Tesla T4", "NVIDIA A100-SXM4-40GB"), narrowed by its memory in GiB where known
    (:func:`.gpu_names.identify`)."""
    return identify(name, CATALOG, memory_gb)


def same_gpu(expected: str, expected_gb: float | None, actual: str, actual_gb: float | None) -> bool:
    """Whether two GPU names (each with its memory in GiB, where known) denote the same card, read
    against this catalog (:func:`.gpu_names.same_device`)."""
    return same_device(expected, expected_gb, actual, actual_gb, CATALOG)


def layer_forward_flops(hidden_size: int, seq_len: int) -> float:
    """Forward FLOPs of one transformer layer for one sample (Megatron-LM accounting)."""
    h, s = float(hidden_size), float(seq_len)
    return 24.0 * s * h * h + 4.0 * s * s * h


def activation_bytes(hidden_size: int, seq_len: int) -> float:
    """One sample's activations of one layer in 16-bit, no recomputation (Korthikanti et al.)."""
    h, s = float(hidden_size), float(seq_len)
    heads = max(1.0, h / HEAD_DIM)
    return 34.0 * s * h + 5.0 * heads * s * s


def estimate_profile(name: str, model: ModelSpec, settings: Settings, where: str = "device") -> DeviceProfile:
    """A catalog-estimated profile (see the module docstring for the formulas)."""
    spec = lookup(name)
    if spec is None:
        raise PlanningError(
            f"{where}: {name!r} is not in the GPU catalog, so it cannot be estimated; use one of "
            f"{', '.join(known_names())} (case and separators are ignored, e.g. 'A100-80GB', 'a100_80g', 'NVIDIA A100-SXM4-80GB'), "
            f"or give measured memory_gb, layer_fwd_ms, layer_bwd_ms and compute_memory_gb"
        )
    missing = [k for k in ("hidden_size", "seq_len") if getattr(model, k) is None]
    if missing:
        raise PlanningError(
            f"{where} ({name}) has no measured profile, so it is estimated from the catalog, which needs "
            f"the model shape: add {' and '.join(f'model.{k}' for k in missing)} to the cluster file "
            f"(e.g. hidden_size: 2560, seq_len: 2048), or give measured layer_fwd_ms, layer_bwd_ms and "
            f"compute_memory_gb for this device"
        )
    assert model.hidden_size is not None and model.seq_len is not None
    per_sample_ms = layer_forward_flops(model.hidden_size, model.seq_len) / (
        spec.tflops * 1e12 * settings.estimated_mfu) * 1e3
    fwd = tuple(m * per_sample_ms + LAUNCH_OVERHEAD_MS for m in range(1, PROFILE_SIZES + 1))
    bwd = tuple(2.0 * f for f in fwd)
    fixed = WORKSPACE_GB + model.layer_parameters * (model.compute_bytes_per_param + 4.0) / GIB
    per_sample_gb = activation_bytes(model.hidden_size, model.seq_len) / GIB
    memory = tuple(fixed + m * per_sample_gb for m in range(1, PROFILE_SIZES + 1))
    return DeviceProfile(name, spec.memory_gb, fwd, bwd, memory, source=ProfileSource.CATALOG)
