"""A plan pinned from a catalog cluster file starts on the real cards it names (the names and memory
CUDA reports, tests/cuda_names.py) and refuses any other card, every rank alike."""

from __future__ import annotations

import pytest

from cephalo_lightning._common.vocabulary import Schedule
from cephalo_lightning.lightning.fit.plan_resolution import DeviceIdentity, check_devices, replanned
from cephalo_lightning.planner import PlanningError, cluster_from_dict, plan
from cephalo_lightning.planner.schema.catalog import CATALOG
from tests.cuda_names import NEIGHBOURS, REPORTED
from tests.plans import plan_of

# node 0: 4x A100-40GB, node 1: 4x RTX 3090, 10 GbE between the hosts; a 1B Llama-shaped model
LAB = {"model": {"name": "llama-1b", "num_layers": 16, "parameters": 1_235_814_400, "hidden_size": 2048,
                 "seq_len": 2048},
       "settings": {"link_bandwidth": "16 GB/s per rank", "inter_node_bandwidth": "10 Gbit/s per link"},
       "nodes": [{"devices": [{"name": "a100-40gb", "count": 4}]}, {"devices": [{"name": "rtx3090", "count": 4}]}]}


def real(*names: tuple[str, float]) -> list[DeviceIdentity]:
    return [DeviceIdentity(rank, name, gib, emulated=False) for rank, (name, gib) in enumerate(names)]


def test_a_plan_of_the_lab_cluster_starts_on_its_real_cards() -> None:
    pinned = plan(cluster_from_dict(LAB), 64)
    a100, rtx3090 = ("NVIDIA A100-SXM4-40GB", 39.59), ("NVIDIA GeForce RTX 3090", 23.69)
    check_devices(pinned, real(*[a100] * 4, *[rtx3090] * 4))
    with pytest.raises(PlanningError) as err:  # the nodes launched the other way round
        check_devices(pinned, real(*[rtx3090] * 4, *[a100] * 4))
    assert all(f"rank {r}:" in str(err.value) for r in range(8))


def catalog_plan():
    by_key = {spec.key: spec for spec in CATALOG}
    keys = [key for _, _, key in REPORTED]
    return plan_of(batches=[1] * len(keys), micro=[1] * len(keys), shares=[1 / len(keys)] * len(keys),
                   devices=keys, memory_capacity_gb=[by_key[k].memory_gb for k in keys])


def test_every_catalog_gpu_starts_on_the_card_cuda_names() -> None:
    check_devices(catalog_plan(), real(*[(name, gib) for name, gib, _ in REPORTED]))


def test_a_card_of_another_catalog_entry_is_refused() -> None:
    pinned = catalog_plan()
    reported = [(name, gib) for name, gib, _ in REPORTED]
    keys = [key for _, _, key in REPORTED]
    shifted = reported[1:] + reported[:1]  # every rank on the next row's card
    with pytest.raises(PlanningError) as err:
        check_devices(pinned, real(*shifted))
    refused = {r for r in range(len(keys)) if f"rank {r}:" in str(err.value)}
    assert refused == {r for r in range(len(keys)) if keys[r] != keys[(r + 1) % len(keys)]}


@pytest.mark.parametrize("name, gib", NEIGHBOURS)
def test_a_neighbouring_card_is_refused(name: str, gib: float) -> None:
    pinned = catalog_plan()
    for rank in range(len(REPORTED)):
        with pytest.raises(PlanningError, match=f"rank {rank}:"):
            check_devices(pinned, real(*[(n, g) if r != rank else (name, gib)
                                         for r, (n, g, _) in enumerate(REPORTED)]))


def test_an_elastic_restart_on_real_cards_replans_from_the_catalog_file() -> None:
    """Six of the lab's eight cards come back: each is found in the cluster file by the catalog's name."""
    present = real(*[("NVIDIA A100-SXM4-40GB", 39.59)] * 4, *[("NVIDIA GeForce RTX 3090", 23.69)] * 2)
    with pytest.warns(UserWarning, match="from the cluster file's profiles"):
        new = replanned(None, cluster_from_dict(LAB), 64, Schedule.LAYERED, lambda: present)
    assert [r.device for r in new.ranks] == ["a100-40gb"] * 4 + ["rtx3090"] * 2
    assert sum(new.batch_sizes) == 64
