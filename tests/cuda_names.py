"""What ``torch.cuda.get_device_name()`` and ``torch.cuda.get_device_properties().total_memory / 2**30``
report on every GPU of the catalog, written down from real machines' logs (nvidia-smi, PyTorch and
TensorFlow device listings), not from the code under test. A card sold in two memory sizes or form
factors has a row for each. Where a figure is less certain it says so.

Names: drivers since about R470 put "NVIDIA " before GeForce and data-centre names ("NVIDIA GeForce
RTX 3090", "NVIDIA A100-SXM4-40GB"); older drivers report "GeForce RTX 3090" and "A100-SXM4-40GB",
rows of their own below. The Tesla-branded cards (V100, T4, P40) keep "Tesla " on every driver.
"""

from __future__ import annotations

# (name as CUDA reports it, GiB as torch reports it, catalog key)
REPORTED: tuple[tuple[str, float, str], ...] = (
    ("NVIDIA GeForce RTX 3090", 23.69, "rtx3090"),  # 24576 MiB less the driver's reservation
    ("GeForce RTX 3090", 23.69, "rtx3090"),  # drivers before R470
    ("NVIDIA GeForce RTX 4090", 23.65, "rtx4090"),
    ("NVIDIA A100-SXM4-40GB", 39.59, "a100-40gb"),
    ("NVIDIA A100-PCIE-40GB", 39.41, "a100-40gb"),
    ("A100-SXM4-40GB", 39.59, "a100-40gb"),  # drivers before R470
    ("NVIDIA A100 80GB PCIe", 79.25, "a100-80gb"),
    ("NVIDIA A100-SXM4-80GB", 79.35, "a100-80gb"),
    ("NVIDIA H100 80GB HBM3", 79.19, "h100"),  # the SXM5 card
    ("NVIDIA H100 PCIe", 79.65, "h100"),  # memory: 81559 MiB as nvidia-smi lists it
    ("NVIDIA H200", 139.8, "h200"),  # the SXM card; 143771 MiB as nvidia-smi lists it, GiB less certain
    ("Tesla V100-SXM2-16GB", 15.78, "v100-16gb"),
    ("Tesla V100-PCIE-16GB", 15.78, "v100-16gb"),
    ("Tesla V100-SXM2-32GB", 31.75, "v100-32gb"),
    ("Tesla V100-PCIE-32GB", 31.75, "v100-32gb"),
    ("Tesla T4", 14.75, "t4"),  # with ECC on (the cloud default)
    ("NVIDIA A10G", 22.0, "a10g"),  # AWS g5; GiB with ECC on, less certain (22.0 to 22.5)
    ("NVIDIA L4", 22.2, "l4"),  # GiB with ECC on, less certain (22.0 to 22.5)
    ("NVIDIA L40S", 44.5, "l40s"),  # GiB with ECC on, less certain
    ("NVIDIA RTX A6000", 47.5, "a6000"),
    ("Tesla P40", 22.38, "p40"),  # with ECC on
)

# Cards outside the catalog whose names are near a catalog card's: none of them is that card.
NEIGHBOURS: tuple[tuple[str, float], ...] = (
    ("NVIDIA GeForce RTX 3090 Ti", 23.69),
    ("NVIDIA GeForce RTX 3080", 9.78),
    ("NVIDIA A10", 22.0),  # the A10 (no G): another card than AWS's A10G
    ("NVIDIA L40", 44.5),
    ("NVIDIA H100 NVL", 93.1),  # 94 GB: another memory than the 80 GB H100s
    ("Tesla V100S-PCIE-32GB", 31.75),
    ("NVIDIA RTX 6000 Ada Generation", 47.5),
    ("NVIDIA A40", 44.5),
)
