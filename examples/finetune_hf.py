"""Fine-tune a pretrained Hugging Face model with LoRA under the Cephalo strategy, then export it.

    python examples/finetune_hf.py --out runs/finetune                      # a tiny local model, 2 CPU ranks
    python examples/finetune_hf.py --out runs/ft --base MODEL_DIR --text TEXT_DIR --accelerator gpu --devices 4

What it does, in order:

1. the pretrained model: ``--base``, a local ``save_pretrained`` directory (model and tokenizer);
   without one, a tiny Llama and a tokenizer trained on the text are written to ``OUT/base``;
2. the data: the ``*.txt`` files of ``--text`` (without it, a few sample files in ``OUT/text``),
   tokenised by the model's tokenizer into a map-style dataset of fixed-length blocks;
3. the fit: LoRA adapters on the attention's q/v projections (peft), the base frozen and read into the
   shards by ``CephaloStrategy(pretrained=BASE)``, ``bf16-mixed``, the ``CephaloCallback`` profiling and
   planning the cluster (on CPU each rank stands in for a GPU of ``--emulate``), W&B offline,
   a checkpoint at the end (``OUT/checkpoints/last.ckpt``);
4. the outputs (rank 0): the adapters alone with peft's ``save_pretrained`` (``OUT/adapters``) and the
   merged model exported from the checkpoint, as ``python -m cephalo_lightning export`` does
   (``OUT/merged``, a plain ``from_pretrained`` directory with the tokenizer), and ``generate()`` on
   ``--prompt`` by the fine-tuned model and by the merged one (the same tokens).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the run's folder (base, text, checkpoints, adapters, merged, wandb)")
    parser.add_argument("--base", default=None, help="a local save_pretrained directory (default: a tiny one in OUT/base)")
    parser.add_argument("--text", default=None, help="a folder of *.txt files (default: sample files in OUT/text)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="the global batch (samples per step, all ranks together)")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--compile", action="store_true", help="compile each decoder block in configure_model()")
    parser.add_argument("--emulate", default="1,2", help="CPU only: each rank's emulated slowdown, comma separated")
    parser.add_argument("--prompt", default="Cephalo trains")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import lightning.pytorch as pl
    import transformers
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import WandbLogger

    from cephalo_lightning import CephaloCallback, CephaloStrategy
    from cephalo_lightning.demo.finetune import LoraCausalLM, TextFilesDataModule, make_pretrained, write_sample_texts
    from cephalo_lightning.runtime.checkpoint.export import export_hf

    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    os.environ.setdefault("WANDB_MODE", "offline")
    out = Path(args.out).resolve()
    text = Path(args.text) if args.text else out / "text"
    base = Path(args.base) if args.base else out / "base"
    rank0 = int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0
    if rank0 and not args.text and not text.exists():
        write_sample_texts(text)
    if rank0 and not args.base and not (base / "config.json").exists():
        make_pretrained(base, text)
    emulate = None
    if args.accelerator == "cpu":
        slowdowns = [float(s) for s in args.emulate.split(",")]
        emulate = [{"slowdown": slowdowns[i % len(slowdowns)]} for i in range(args.devices)]
    checkpoints = out / "checkpoints"
    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=args.devices, max_steps=args.steps, precision=args.precision,
        # only rank 0 uses the module after the fit: the whole model is gathered there alone
        strategy=CephaloStrategy(pretrained=str(base), emulate=emulate, gather_on_teardown="rank0"),
        callbacks=[CephaloCallback(max_micro_batch=2, cache_dir=str(out / "profiles"), quiet=True),
                   ModelCheckpoint(dirpath=checkpoints, save_last=True, save_top_k=0)],
        logger=WandbLogger(project="cephalo-finetune", save_dir=str(out), offline=True),
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    module = LoraCausalLM(str(base), compile=args.compile)
    trainer.fit(module, TextFilesDataModule(str(text), str(base), seq_len=args.seq_len, batch_size=args.batch))
    if not trainer.is_global_zero:
        return
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    prompt = tokenizer(args.prompt, return_tensors="pt")["input_ids"]
    # rank 0's module holds the whole trained model after the fit: peft writes the adapters alone
    module.model.save_pretrained(out / "adapters")
    tuned = module.model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    merged = out / "merged"
    if merged.exists():
        shutil.rmtree(merged)
    export_hf(checkpoints / "last.ckpt", merged)  # = python -m cephalo_lightning export ... --hf OUT/merged
    tokenizer.save_pretrained(merged)
    model = transformers.AutoModelForCausalLM.from_pretrained(merged)
    exported = model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)
    print(f"adapters: {sorted(p.name for p in (out / 'adapters').iterdir())}")
    print(f"merged model: {merged}")
    print(f"fine-tuned: {tokenizer.decode(tuned[0])!r}")
    print(f"merged:     {tokenizer.decode(exported[0])!r}")
    print("same tokens" if tuned.tolist() == exported.tolist() else "DIFFERENT tokens")


if __name__ == "__main__":
    main()
