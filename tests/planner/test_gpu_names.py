"""The GPU-name matcher against the names CUDA reports (tests/cuda_names.py, a table written from real
machines): each real name is its catalog key and no other, both ways, and the cards beside the
catalog's are none of its keys."""

from __future__ import annotations

import pytest

from cephalo_lightning.planner.schema.catalog import CATALOG, known_names, lookup, same_gpu
from cephalo_lightning.planner.schema.gpu_names import read
from tests.cuda_names import NEIGHBOURS, REPORTED

SPEC = {spec.key: spec for spec in CATALOG}


def test_the_table_covers_the_catalog() -> None:
    assert {key for _, _, key in REPORTED} == set(known_names())


@pytest.mark.parametrize("name, gib, key", REPORTED)
def test_a_reported_name_is_its_catalog_gpu(name: str, gib: float, key: str) -> None:
    found, with_memory = lookup(name), lookup(name, gib)
    assert found is not None and found.key == key
    assert with_memory is not None and with_memory.key == key


@pytest.mark.parametrize("name, gib, key", REPORTED)
def test_a_reported_name_matches_its_key_and_no_other(name: str, gib: float, key: str) -> None:
    # the pinned-plan check's question: a plan's rank on catalog key k (with k's memory), this rank's device
    matching = [k for k, spec in SPEC.items() if same_gpu(k, spec.memory_gb, name, gib)]
    assert matching == [key]


@pytest.mark.parametrize("key", sorted(SPEC))
def test_a_catalog_key_matches_exactly_its_reported_names(key: str) -> None:
    spec = SPEC[key]
    assert {name for name, gib, _ in REPORTED if same_gpu(key, spec.memory_gb, name, gib)} == \
        {name for name, _, k in REPORTED if k == key}


def test_reported_names_match_each_other_as_their_keys_do() -> None:
    """A plan profiled on one card (its CUDA name) against a rank on another."""
    for name, gib, key in REPORTED:
        for other, other_gib, other_key in REPORTED:
            assert same_gpu(name, gib, other, other_gib) == (key == other_key), (name, other)


@pytest.mark.parametrize("name, gib", NEIGHBOURS)
def test_neighbouring_cards_are_no_catalog_gpu(name: str, gib: float) -> None:
    assert lookup(name, gib) is None
    assert [k for k, spec in SPEC.items() if same_gpu(k, spec.memory_gb, name, gib)] == []


def test_memory_tells_apart_what_the_name_cannot() -> None:
    """"a100" alone is the catalog's alias for the 40 GB card; its memory names the 80 GB one."""
    assert lookup("a100").key == "a100-40gb"
    assert lookup("a100", 79.2).key == "a100-80gb"
    assert not same_gpu("a100", 39.4, "NVIDIA A100-SXM4-80GB", 79.35)


@pytest.mark.parametrize("name, model, stated", [
    ("NVIDIA A100 80GB PCIe", "a100", 80), ("a100_80g", "a100", 80), ("NVIDIA H100 80GB HBM3", "h100", 80),
    ("NVIDIA GeForce RTX 3090", "3090", None), ("rtx3090", "3090", None), ("NVIDIA RTX A6000", "a6000", None),
    ("NVIDIA A10G", "a10g", None), ("Tesla V100-SXM2-16GB", "v100", 16)])
def test_a_name_reads_as_the_module_says(name: str, model: str, stated: int | None) -> None:
    reading = read(name)
    assert (reading.model, reading.stated_gb) == (model, stated)
