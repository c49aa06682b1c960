"""The Hugging Face configs for two mixed nodes (``configs/hf/``): they parse, name a cluster file that
describes their hardware with its links, and build on CPU with a tiny local model.

* parsed by the CLI's own parser (``--print_config``, nothing instantiated): GPU, 2 nodes x 4 devices,
  the pretrained directory read into the shards and used as the tokenizer, a process-group timeout;
* the cluster file each names in its header loads, has the config's ranks on 2 nodes with the
  inter-node link written, and the model's sequence length; for LoRA its trainable count is the
  adapters' own, computed here from the config's rank and targets and Llama-3-8B's shapes;
* built for real on one CPU rank (Trainer, strategy, callbacks, logger, model, data; nothing fitted),
  the base and data overridden with a tiny local model and two records: the data module's first
  batch is ``seq_len`` wide and masks the prompt.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from cephalo_lightning import load_cluster
from tests.cli_config import print_config

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[1]
HF_CONFIGS = sorted((ROOT / "configs" / "hf").glob("*.yaml"))
CLUSTER = re.compile(r"configs/clusters/[\w.-]+\.yaml")
# Llama-3-8B: 32 layers, hidden 4096, 8 key-value heads of 128 (k and v project to 1024)
LLAMA_8B = {"layers": 32, "q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024),
            "o_proj": (4096, 4096)}


def _ids(paths: list[Path]) -> list[str]:
    return [p.stem for p in paths]


def test_there_is_a_lora_and_a_full_training_config():
    assert {p.stem.split("-")[0] for p in HF_CONFIGS} == {"lora", "full"}
    for path in HF_CONFIGS:
        assert "NOT RUN HERE" in path.read_text(), f"{path.name} must say it was not run on GPUs"


@pytest.mark.parametrize("path", HF_CONFIGS, ids=_ids(HF_CONFIGS))
def test_hf_config_parses_for_two_nodes(path):
    config = print_config(path)
    trainer, base = config["trainer"], config["vars"]["base"]
    assert (trainer["accelerator"], trainer["num_nodes"], trainer["devices"]) == ("gpu", 2, 4)
    assert trainer["precision"] == "bf16-mixed"
    strategy = trainer["strategy"]
    assert strategy["class_path"] == "cephalo_lightning.CephaloStrategy"
    assert strategy["init_args"]["pretrained"] == base and strategy["init_args"]["timeout"] == "0:30:00"
    assert config["model"]["init_args"]["base"] == base and config["data"]["init_args"]["tokenizer"] == base
    assert config["data"]["class_path"].endswith("InstructionDataModule")
    assert trainer["default_root_dir"] == config["vars"]["out"] and "${" not in yaml.safe_dump(config)


def _cluster_file(path: Path) -> Path:
    named = set(CLUSTER.findall(path.read_text()))
    assert len(named) == 1, f"{path.name} must name one cluster file, names {sorted(named)}"
    return ROOT / named.pop()


@pytest.mark.parametrize("path", HF_CONFIGS, ids=_ids(HF_CONFIGS))
def test_hf_config_names_a_cluster_file_of_its_hardware_with_its_links(path):
    config = yaml.safe_load(path.read_text())
    cluster = load_cluster(_cluster_file(path))
    trainer = config["trainer"]
    assert cluster.num_nodes == trainer["num_nodes"] and cluster.world_size == trainer["num_nodes"] * trainer["devices"]
    assert cluster.settings.inter_node_bandwidth_gbps == pytest.approx(10 / 8 / 4)  # 10 GbE over a node's 4 ranks
    assert cluster.model.seq_len == config["data"]["init_args"]["seq_len"]
    init = config["model"]["init_args"]
    if config["model"]["class_path"].endswith("LoraCausalLM"):
        r = init["r"]
        adapters = LLAMA_8B["layers"] * sum(r * (fan_in + fan_out) for fan_in, fan_out in
                                            (LLAMA_8B[t] for t in init["targets"]))
        assert cluster.model.trainable == adapters
    else:
        assert cluster.model.trainable == cluster.model.parameters


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from cephalo_lightning.demo.finetune import make_pretrained
    from cephalo_lightning.demo.finetune_data import write_sample_texts

    folder = tmp_path_factory.mktemp("tiny-hf")
    base = make_pretrained(folder / "base", write_sample_texts(folder / "text"))
    data = folder / "train.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": "Cephalo trains", "response": f"transformers {i}"}) for i in range(2)))
    return {"base": base, "data": data}


@pytest.mark.parametrize("path", HF_CONFIGS, ids=_ids(HF_CONFIGS))
def test_hf_config_builds_on_cpu_with_a_tiny_local_model(path, tiny, tmp_path, monkeypatch):
    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.demo.finetune import CausalLM, LoraCausalLM
    from cephalo_lightning.lightning.cli import run_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    # the CLI's own settings (--vars overrides reach every interpolation), with run=False: build, do not fit
    cli = run_cli(["--config", str(path), f"--vars.base={tiny['base']}", f"--vars.data={tiny['data']}",
                   f"--vars.out={tmp_path / 'out'}", "--trainer.accelerator=cpu", "--trainer.devices=1",
                   "--trainer.num_nodes=1"], run=False)
    strategy = cli.trainer.strategy
    assert isinstance(strategy, CephaloStrategy) and strategy.config.pretrained == tiny["base"]
    assert strategy._timeout == timedelta(minutes=30)
    assert any(isinstance(c, CephaloCallback) for c in cli.trainer.callbacks)
    assert isinstance(cli.model, LoraCausalLM if path.stem.startswith("lora") else CausalLM)
    batch = next(iter(cli.datamodule.train_dataloader()))
    seq_len = cli.datamodule.seq_len
    assert tuple(batch["input_ids"].shape) == (2, seq_len)
    prompt = len(transformers.AutoTokenizer.from_pretrained(tiny["base"])("Cephalo trains")["input_ids"])
    assert (batch["labels"][:, :prompt] == -100).all() and (batch["labels"][:, prompt] != -100).all()
