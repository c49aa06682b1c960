r"""Fine-tune a pretrained Hugging Face model (LoRA adapters, or every parameter) under the Cephalo strategy, then export it.

    python examples/finetune_hf.py --out runs/finetune                      # a tiny local model, 2 CPU ranks
    python examples/finetune_hf.py --out runs/ft --base MODEL_DIR --text TEXT_DIR --accelerator gpu --devices 4
    srun python examples/finetune_hf.py --out /shared/runs/ft --base MODEL_DIR --data train.jsonl \
        --accelerator gpu --devices 4 --num-nodes 2                          # inside an sbatch, one task per GPU
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank R --master-addr HOST --master-port 29500 \
        examples/finetune_hf.py --out /shared/runs/ft --base MODEL_DIR --data train.jsonl \
        --accelerator gpu --devices 4 --num-nodes 2

What it does, in order:

1. the pretrained model: ``--base``, a local ``save_pretrained`` directory (model and tokenizer);
   without one, a tiny Llama and a tokenizer trained on the text are written to ``OUT/base``;
2. the data: instruction records with ``--data`` (a .json/.jsonl file or a folder of them, records
   ``{"prompt": ..., "response": ...}``: the prompt's tokens carry no loss), else the ``*.txt`` files of
   ``--text`` (without it, a few sample files in ``OUT/text``) cut into fixed-length blocks; a
   tokenizer without a pad token pads with its end-of-sequence token, padding carries no loss;
3. the fit: LoRA adapters on the attention's q/v projections (peft; ``--full``: every parameter),
   the base read into the shards by ``CephaloStrategy(pretrained=BASE)`` (``--quantize nf4``: its
   matrices quantised to 4-bit NF4 blocks as each rank reads them, QLoRA; else stored in bf16),
   ``bf16-mixed`` (fp32 adapters under autocast), the
   ``CephaloCallback`` profiling and planning the cluster (on CPU each rank stands in for a GPU of
   ``--emulate``), W&B offline, a checkpoint at the end (``OUT/checkpoints/last.ckpt``);
4. the outputs (global rank 0): the adapters alone with peft's ``save_pretrained`` (``OUT/adapters``,
   LoRA only) and the model exported from the checkpoint, as ``python -m cephalo_lightning export``
   does (``OUT/merged``, a plain ``from_pretrained`` directory with the tokenizer), and ``generate()``
   on ``--prompt`` by the fine-tuned model and by the exported one (the same tokens).

Ranks come from the launcher, as Lightning detects it: ``srun`` (``SLURM_PROCID`` / ``SLURM_LOCALID`` /
``SLURM_NODEID``), ``torchrun`` (``RANK`` / ``LOCAL_RANK`` / ``GROUP_RANK``), or Lightning's own
launcher (``--devices`` processes on this machine). Under ``srun`` or ``torchrun`` every process runs
this script at once, so ``--base`` and ``--text`` / ``--data`` must name existing, shared files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the run's folder (base, text, checkpoints, adapters, merged, wandb)")
    parser.add_argument("--base", default=None, help="a local save_pretrained directory (default: a tiny one in OUT/base)")
    parser.add_argument("--text", default=None, help="a folder of *.txt files (default: sample files in OUT/text)")
    parser.add_argument("--data", default=None, help="instruction data: a .json/.jsonl file or a folder of them "
                        "(records {\"prompt\": ..., \"response\": ...}); replaces --text")
    parser.add_argument("--full", action="store_true", help="train every parameter instead of LoRA adapters")
    parser.add_argument("--quantize", choices=("none", "nf4"), default="none",
                        help="LoRA only: store the frozen base as 4-bit NF4 blocks (QLoRA; the `qlora` extra)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3 for LoRA, 1e-5 with --full)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="processes (GPUs) per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (srun's --nodes, torchrun's --nnodes)")
    parser.add_argument("--timeout-min", type=float, default=30.0,
                        help="process-group timeout: the longest one rank may wait for another (a step, a save, the "
                        "pretrained load), in minutes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="the global batch (samples per step, all ranks together)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--precision", default="bf16-mixed",
                        help="bf16-mixed / bf16-true store the frozen base in bf16, 32-true in fp32")
    parser.add_argument("--compile", action="store_true", help="compile each decoder block in configure_model()")
    parser.add_argument("--emulate", default="1,2", help="CPU only: each rank's emulated slowdown, comma separated")
    parser.add_argument("--prompt", default="Cephalo trains")
    return parser.parse_args(argv)


def launched_externally() -> bool:
    """Whether ``srun`` or ``torchrun`` started every process (Lightning's own detection)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    return SLURMEnvironment.detect() or TorchElasticEnvironment.detect()


def build_trainer(args: argparse.Namespace, base: Path, out: Path):  # noqa: ANN201 - a pl.Trainer
    """The Trainer: Lightning picks the cluster environment (SLURM, torchrun or its own launcher) and
    with it every rank's global, node and local rank."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import WandbLogger

    from cephalo_lightning import CephaloCallback, CephaloStrategy

    emulate = None
    if args.accelerator == "cpu":
        slowdowns = [float(s) for s in args.emulate.split(",")]
        emulate = [{"slowdown": slowdowns[i % len(slowdowns)]} for i in range(args.devices * args.num_nodes)]
    return pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, num_nodes=args.num_nodes, max_steps=args.steps,
        precision=args.precision,
        # only rank 0 uses the module after the fit: the whole model is gathered there alone
        strategy=CephaloStrategy(pretrained=str(base), emulate=emulate, gather_on_teardown="rank0",
                                 base_storage="nf4" if args.quantize == "nf4" else "compute",
                                 timeout=timedelta(minutes=args.timeout_min)),
        callbacks=[CephaloCallback(max_micro_batch=2, cache_dir=str(out / "profiles"), quiet=True),
                   ModelCheckpoint(dirpath=out / "checkpoints", save_last=True, save_top_k=0)],
        logger=WandbLogger(project="cephalo-finetune", save_dir=str(out), offline=True),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.full and args.quantize != "none":
        sys.exit("error: --quantize stores a frozen base, and --full freezes nothing: drop one of them")
    import torch
    import transformers

    from cephalo_lightning.demo.finetune import CausalLM, LoraCausalLM, make_pretrained
    from cephalo_lightning.demo.finetune_data import InstructionDataModule, TextFilesDataModule, write_sample_texts
    from cephalo_lightning.runtime.checkpoint.export import export_hf

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    os.environ.setdefault("WANDB_MODE", "offline")
    out = Path(args.out).resolve()
    text = Path(args.text) if args.text else out / "text"
    base = Path(args.base) if args.base else out / "base"
    if launched_externally() and not (args.base and (args.text or args.data)):
        sys.exit("error: under srun or torchrun every process starts this script at once, so the files cannot be "
                 "made here: give --base (a save_pretrained directory) and --text or --data on a shared filesystem")
    # Lightning's own launcher starts the other ranks inside fit(), after these files exist
    if not args.text and not args.data and not text.exists():
        write_sample_texts(text)
    if not args.base and not (base / "config.json").exists():
        make_pretrained(base, text)
    trainer = build_trainer(args, base, out)
    lr = args.lr if args.lr is not None else 1e-5 if args.full else 1e-3
    module = CausalLM(str(base), lr=lr, compile=args.compile) if args.full else \
        LoraCausalLM(str(base), lr=lr, compile=args.compile)
    data = (InstructionDataModule(args.data, str(base), seq_len=args.seq_len, batch_size=args.batch) if args.data
            else TextFilesDataModule(str(text), str(base), seq_len=args.seq_len, batch_size=args.batch))
    trainer.fit(module, data)
    if not trainer.is_global_zero:
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(base, local_files_only=True)
    prompt = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    # rank 0's module holds the whole trained model after the fit: peft writes the adapters alone
    if not args.full:
        module.model.save_pretrained(out / "adapters")
        print(f"adapters: {sorted(p.name for p in (out / 'adapters').iterdir())}")
    merged = out / "merged"
    if merged.exists():
        shutil.rmtree(merged)
    done = export_hf(out / "checkpoints" / "last.ckpt", merged)  # = python -m cephalo_lightning export ... --hf OUT/merged
    if done.note:  # a 4-bit base is exported dequantised in bf16: the fine-tuned model is compared in bf16 too
        print(done.note)
        module.model.to(torch.bfloat16)
    tuned = module.model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    tokenizer.save_pretrained(merged)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, local_files_only=True)
    exported = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    print(f"merged model: {merged}")
    print(f"fine-tuned: {tokenizer.decode(tuned[0])!r}")
    print(f"merged:     {tokenizer.decode(exported[0])!r}")
    print("same tokens" if tuned.tolist() == exported.tolist() else "DIFFERENT tokens")


if __name__ == "__main__":
    main()
