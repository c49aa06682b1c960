"""What the end of a fit gathers (``gather_on_teardown``), decided for the model's size and said with
the memory it takes, before any gather: the default keeps a model over 8 GiB sharded (an 8B model
in fp32 would take 32 GB on every rank at once) and hands a smaller one back whole, as before.
The 2-rank hand-backs themselves are checked in tests/models/test_user_models.py."""

from __future__ import annotations

import pytest

from cephalo_lightning._common.vocabulary import AUTO, Handback
from cephalo_lightning.runtime.sharding.handback import AUTO_WHOLE_LIMIT_BYTES, decide

LLAMA_8B = 8_030_261_248  # parameters of Llama-3-8B
LLAMA_1B = 1_235_814_400  # parameters of Llama-3.2-1B


def test_the_size_default_gathers_up_to_8_gib_and_nothing_above():
    assert AUTO_WHOLE_LIMIT_BYTES == 8 * 2**30
    assert decide(AUTO, 8 * 2**30, 4).handback is Handback.ALL  # at the limit: as before
    assert decide(AUTO, 8 * 2**30 + 1, 4).handback is Handback.NONE
    assert decide(AUTO, 4 * LLAMA_1B, 4).handback is Handback.ALL  # 4.6 GiB in fp32
    assert decide(AUTO, 4 * LLAMA_8B, 4).handback is Handback.NONE  # 29.9 GiB in fp32


@pytest.mark.parametrize(("choice", "model", "line"), [
    (AUTO, LLAMA_8B, "Cephalo: gather_on_teardown='auto': the whole model is 29.9 GiB, over the 8 GiB limit; not "
                     "gathered: the module keeps its shard pieces and refuses use (gather_on_teardown='rank0' gives "
                     "the whole model to rank 0; or export a checkpoint)"),
    (AUTO, LLAMA_1B, "Cephalo: gather_on_teardown='auto': the whole model is 4.6 GiB, at most the 8 GiB limit; "
                     "gathering it whole on every rank: 4.6 GiB of host memory per rank, 18.4 GiB on a node of 4"),
    (Handback.ALL, LLAMA_8B, "Cephalo: gather_on_teardown='all': the whole model is 29.9 GiB; gathering it whole on "
                             "every rank: 29.9 GiB of host memory per rank, 120 GiB on a node of 4"),
    (Handback.RANK0, LLAMA_8B, "Cephalo: gather_on_teardown='rank0': the whole model is 29.9 GiB; gathering it whole "
                               "on global rank 0 only: 29.9 GiB of host memory there, none elsewhere"),
])
def test_the_line_says_what_is_gathered_where_and_the_memory_it_takes(choice, model, line):
    """The figures: parameters x 4 bytes (fp32 masters) / 2**30, and x 4 ranks for the node."""
    assert decide(choice, 4 * model, 4).line == line


def test_an_explicit_choice_is_kept_whatever_the_size():
    for choice in Handback:
        assert decide(choice, 4 * LLAMA_8B, 8).handback is choice
        assert decide(choice, 1024, 8).handback is choice
