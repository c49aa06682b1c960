"""Fine-tuning data from local files: every item ``seq_len`` long, padding and prompts carry no loss.

The tokenizer is built here from a handful of words (``tokenizers``' WordLevel model: one id per
word, split on whitespace, no special token added) and, like Llama-3's and Mistral's, has no pad
token; so every expected id and label list below is read off ``VOCAB`` by hand. The loss check
compares a padded item with the same tokens unpadded, through a tiny Llama in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from cephalo_lightning._common.errors import ConfigurationError  # noqa: E402
from cephalo_lightning.demo.finetune_data import (  # noqa: E402
    IGNORE,
    InstructionData,
    InstructionDataModule,
    TokenizedText,
)

VOCAB = ["<unk>", "</s>", "what", "is", "two", "plus", "four", "the", "sky", "blue", "ok"]
EOS = 1  # the fill id too: there is no pad token
X = IGNORE  # a label that carries no loss

QA = {"prompt": "what is two plus two", "response": "four"}  # 5 prompt tokens, 1 response token + eos
SKY = {"prompt": "is the sky blue", "response": "ok ok ok ok ok ok"}  # 4 + 6 + eos: truncated at 9
LONG = {"prompt": "what is two plus two what is two plus two", "response": "four"}  # 10 prompt tokens
SEQ = 9


def _no_pad_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="</s>", unk_token="<unk>")
    assert fast.pad_token_id is None and fast.eos_token_id == EOS
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return _no_pad_tokenizer(tmp_path_factory.mktemp("no-pad-tokenizer"))


def _lists(item: dict[str, torch.Tensor]) -> tuple[list[int], list[int], list[int]]:
    return item["input_ids"].tolist(), item["attention_mask"].tolist(), item["labels"].tolist()


def test_text_blocks_with_a_short_last_block_pad_with_eos_and_mask_the_padding(tokenizer, tmp_path):
    """Today's crash: a tokenizer without a pad token and a last block shorter than seq_len."""
    (tmp_path / "a.txt").write_text("what is two plus two")  # 5 tokens + eos = 6: blocks of 4 and 2
    data = TokenizedText(tmp_path, tokenizer, seq_len=4)
    assert [_lists(data[i]) for i in range(len(data))] == [
        ([2, 3, 4, 5], [1, 1, 1, 1], [2, 3, 4, 5]),
        ([4, EOS, EOS, EOS], [1, 1, 0, 0], [4, EOS, X, X]),
    ]


def test_padding_carries_no_loss(tokenizer, tmp_path):
    """A padded item's loss equals the loss of its real tokens alone (a tiny Llama, float64)."""
    (tmp_path / "a.txt").write_text("what is two plus two")
    padded = TokenizedText(tmp_path, tokenizer, seq_len=4)[1]
    config = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        with_padding = model(**{k: v[None] for k, v in padded.items()}).loss
        alone = model(input_ids=torch.tensor([[4, EOS]]), labels=torch.tensor([[4, EOS]])).loss
    assert torch.isfinite(with_padding)
    assert with_padding.item() == pytest.approx(alone.item(), rel=1e-12)


def _write(folder: Path, records: list[dict], suffix: str) -> Path:
    path = folder / f"train{suffix}"
    text = "\n".join(json.dumps(r) for r in records) if suffix == ".jsonl" else json.dumps(records)
    path.write_text(text)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_instruction_records_mask_the_prompt_and_the_padding(tokenizer, tmp_path, suffix):
    path = _write(tmp_path, [QA, SKY], suffix)
    data = InstructionData(path, tokenizer, seq_len=SEQ)
    assert [_lists(data[i]) for i in range(len(data))] == [
        # what is two plus two | four </s> | fill
        ([2, 3, 4, 5, 4, 6, EOS, EOS, EOS], [1] * 7 + [0] * 2, [X, X, X, X, X, 6, EOS, X, X]),
        # is the sky blue | ok x 5 (the sixth and eos cut at seq_len)
        ([3, 7, 8, 9, 10, 10, 10, 10, 10], [1] * 9, [X, X, X, X, 10, 10, 10, 10, 10]),
    ]


def test_a_record_whose_prompt_fills_seq_len_is_left_out_with_a_warning(tokenizer, tmp_path):
    path = _write(tmp_path, [QA, LONG], ".jsonl")
    with pytest.warns(UserWarning, match=r"1 record\(s\) have a prompt of seq_len=9 tokens or more, .*train.jsonl:2"):
        data = InstructionData(path, tokenizer, seq_len=SEQ)
    assert len(data) == 1
    with pytest.raises(ConfigurationError, match="no other record: raise seq_len"):
        InstructionData(_write(tmp_path, [LONG], ".json"), tokenizer, seq_len=SEQ)


def test_bad_records_and_remote_tokenizers_are_refused_by_name(tokenizer, tmp_path):
    path = _write(tmp_path, [QA, {"instruction": "what is two plus two", "output": "four"}], ".jsonl")
    with pytest.raises(ConfigurationError, match=r"train.jsonl:2: a record needs the strings 'prompt' and 'response', "
                                                 r"got \['instruction', 'output'\]; name other keys with prompt_key="):
        InstructionData(path, tokenizer, seq_len=SEQ)
    renamed = _write(tmp_path, [{"instruction": QA["prompt"], "output": QA["response"]}], ".json")
    assert _lists(InstructionData(renamed, tokenizer, seq_len=SEQ, prompt_key="instruction", response_key="output")[0]) \
        == _lists(InstructionData(_write(tmp_path, [QA], ".jsonl"), tokenizer, seq_len=SEQ)[0])
    with pytest.raises(ConfigurationError, match="'meta-llama/Meta-Llama-3-8B' is not a local directory"):
        InstructionData(_write(tmp_path, [QA], ".json"), "meta-llama/Meta-Llama-3-8B", seq_len=SEQ)
    with pytest.raises(ConfigurationError, match="must be a .json or .jsonl file"):
        InstructionData(tmp_path / "missing.csv", tokenizer, seq_len=SEQ)


def test_the_data_module_batches_whole_items(tokenizer, tmp_path):
    module = InstructionDataModule(str(_write(tmp_path, [QA, SKY, QA], ".jsonl")), str(tokenizer), seq_len=SEQ,
                                   batch_size=3, shuffle=False)
    batch = next(iter(module.train_dataloader()))
    assert {k: tuple(v.shape) for k, v in batch.items()} == {k: (3, SEQ) for k in ("input_ids", "attention_mask",
                                                                                   "labels")}
    assert batch["labels"][0].tolist() == batch["labels"][2].tolist() == [X, X, X, X, X, 6, EOS, X, X]
