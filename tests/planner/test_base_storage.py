"""The frozen base's stored bytes per parameter, per storage kind, against the analytic values."""

from __future__ import annotations

import pytest

from cephalo_lightning._common.vocabulary import BaseStorage
from cephalo_lightning.planner import PlanningError, cluster_from_dict, plan
from cephalo_lightning.planner.cost.base_storage import llama_matrix_fraction, nf4_bytes_per_param, weight_bytes_per_param


def test_each_storage_costs_what_it_holds() -> None:
    assert weight_bytes_per_param(BaseStorage.COMPUTE, 4.0) == 4.0  # an fp32 copy of the base
    assert weight_bytes_per_param("compute") == 2.0
    # a 4-bit code and a 4-byte scale shared by 64 elements
    assert nf4_bytes_per_param() == 0.5625 == 0.5 + 4 / 64
    assert nf4_bytes_per_param(256) == 0.5 + 4 / 256
    assert weight_bytes_per_param(BaseStorage.NF4) == 0.5625
    # what is not quantised stays in bf16
    assert weight_bytes_per_param(BaseStorage.NF4, 2.0, 0.75) == pytest.approx(0.75 * 0.5625 + 0.25 * 2)
    assert weight_bytes_per_param(BaseStorage.NF4, 2.0, 0.0) == 2.0
    # a Llama-3-8B's vectors are its 65 RMS norms of 4096
    assert llama_matrix_fraction(8_030_261_248, 32, 4096) == 1 - 65 * 4096 / 8_030_261_248
    assert llama_matrix_fraction(1000, 2, 10) == 0.95


def test_bad_storage_input_is_refused() -> None:
    with pytest.raises(ValueError, match="'int4' is not a valid BaseStorage"):
        weight_bytes_per_param("int4")
    with pytest.raises(PlanningError, match="between 0 and 1"):
        weight_bytes_per_param("nf4", 2.0, 1.5)
    with pytest.raises(PlanningError, match="use 2 .* or 4"):
        weight_bytes_per_param("compute", 3.0)
    with pytest.raises(PlanningError, match="positive even"):
        nf4_bytes_per_param(63)
    with pytest.raises(PlanningError, match="do not fit"):
        llama_matrix_fraction(100, 10, 10)


def test_the_planner_charges_a_smaller_base_less_memory() -> None:
    """The same LoRA job on the same cards: each rank's predicted memory falls by the stored bytes saved."""
    def memory(storage: str, compute_bytes: float = 2.0) -> list[float]:
        """Each rank's predicted memory, over the shard groups (each group stores the whole state once)."""
        model = {"name": "m", "num_layers": 8, "parameters": 2_000_000_000, "hidden_size": 2048, "seq_len": 512,
                 "trainable_parameters": 4_000_000, "weight_bytes_per_param": weight_bytes_per_param(storage, compute_bytes)}
        p = plan(cluster_from_dict({"model": model, "settings": {"link_bandwidth": "16 GB/s per rank"},
                                    "devices": [{"name": "rtx4090", "count": 2}]}), 8)
        return [r.predicted_memory_gb / len(p.shard_groups) for r in p.ranks]

    fp32, bf16, nf4 = memory("compute", 4.0), memory("compute"), memory("nf4")
    frozen = 2_000_000_000 - 4_000_000
    for a, b, c in zip(fp32, bf16, nf4):
        assert a > b > c
    assert sum(fp32) - sum(bf16) == pytest.approx(frozen * 2 / 2**30, rel=1e-3)
    assert sum(bf16) - sum(nf4) == pytest.approx(frozen * (2 - 0.5625) / 2**30, rel=1e-3)


def test_a_frozen_parameter_is_gathered_at_its_stored_bytes_where_fewer() -> None:
    from dataclasses import replace

    from cephalo_lightning.planner.schema.cluster_spec import ModelSpec

    nf4 = ModelSpec(name="m", num_layers=2, parameters=1000, trainable_parameters=100, weight_bytes_per_param=0.5625)
    assert nf4.gathered_bytes_per_param == (2 * 100 + 0.5625 * 900) / 1000
    assert replace(nf4, weight_bytes_per_param=4.0).gathered_bytes_per_param == 2.0  # an fp32 copy: gathered in bf16
    assert replace(nf4, trainable_parameters=None).gathered_bytes_per_param == 2.0  # nothing frozen
