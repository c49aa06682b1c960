"""Cephalo from plain Python: ``Trainer(strategy=CephaloStrategy(...), callbacks=[CephaloCallback(...)])``.

What it shows, with no CLI or config file in between:

* ``CephaloStrategy`` shards the model unevenly and gives every rank its own batch slice and
  micro-batch count; ``CephaloCallback`` profiles each rank's device at ``setup``, plans, prints
  the plan table and, at the end, measured against predicted throughput;
* on CPU (the default) the two ranks are an *emulated* heterogeneous pair: rank 0 is fast with
  little memory, rank 1 is three times slower with plenty of memory. Every time and capacity is
  emulated, so the figures say nothing about real GPUs; they show the mechanics;
* the same script runs on real GPUs without emulation, the devices being profiled as they are::

      python examples/train_plain.py                                   # 2 emulated CPU ranks
      python examples/train_plain.py --steps 3 --preset tiny           # a smoke run (~25 s)
      python examples/train_plain.py --accelerator gpu --devices 4     # real GPUs (not run here)
      python examples/train_plain.py --resume runs/train_plain/checkpoints/last.ckpt --steps 60

The global batch (``--global-batch``, samples per optimizer step over all ranks) is the
DataLoader's ``batch_size``; Cephalo re-cuts every global batch into the plan's per-rank slices.
A checkpoint is a sharded directory that any later plan or world size can resume from.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from cephalo_lightning import CephaloCallback, CephaloStrategy
from cephalo_lightning.demo import GPTModule, TextDataModule

# Two kinds of emulated device, as in configs/quickstart.yaml: compute and memory do not scale
# together. memory_gb is the capacity the rank may use (enforced by counting tensors on CPU).
FAST_SMALL = {"slowdown": 1.0, "memory_gb": 0.02}
SLOW_LARGE = {"slowdown": 3.0, "memory_gb": 0.5}


def emulated_cluster(world_size: int) -> list[dict[str, float]]:
    """The first half of the ranks fast and small, the rest slow and large (at least one of each)."""
    fast = max(1, world_size // 2)
    return [dict(FAST_SMALL) if rank < fast else dict(SLOW_LARGE) for rank in range(world_size)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps (default: 40)")
    parser.add_argument("--devices", type=int, default=2, help="ranks (processes) on this machine (default: 2)")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu", "cuda"),
                        help="cpu: emulated heterogeneous ranks (default); gpu: real devices, no emulation")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (see examples/multinode.md)")
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "gpt2-124m"),
                        help="GPT size (default: small, ~0.9M parameters)")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step, all ranks together")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    parser.add_argument("--precision", default=None,
                        help="Lightning precision (default: 32-true on CPU, bf16-mixed on GPU; "
                             "use 16-mixed on V100/T4 and 32-true with a P40, which lack bf16)")
    parser.add_argument("--no-emulate", action="store_true", help="CPU ranks as they are (a homogeneous cluster)")
    parser.add_argument("--out", type=Path, default=Path("runs/train_plain"), help="profiles, plan, logs, checkpoints")
    parser.add_argument("--resume", type=Path, default=None,
                        help="a checkpoint to resume from (any plan, any number of ranks)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    on_cpu = args.accelerator == "cpu"
    pl.seed_everything(0, workers=True)

    # Emulation only makes sense on CPU ranks: on GPUs the devices are heterogeneous for real.
    emulate = emulated_cluster(args.devices * args.num_nodes) if on_cpu and not args.no_emulate else None
    strategy = CephaloStrategy(emulate=emulate)
    watcher = CephaloCallback(
        max_micro_batch=4,  # profile micro-batch sizes 1..4; the cost model extrapolates beyond
        cache_dir=args.out / "profiles",  # a restart with the same model and devices skips profiling
        cluster_file=args.out / "cluster.yaml",  # the profiled cluster, for offline re-planning
        plan_file=args.out / "plan.json",  # pin it later with CephaloStrategy(plan=...)
        watch_every_n_steps=max(2, min(20, args.steps // 2)),
        # emulated capacities are tiny; use more of them than the 75% a real GPU is planned with
        settings={"usable_memory_fraction": 0.9} if emulate else None,
    )
    # Saved at every validation (val_check_interval below: the last step). Nothing derived from
    # --steps goes in here: the arguments make up the callback's key in the checkpoint, and a resume
    # with another --steps must find its state (else Lightning warns and writes last-v1.ckpt).
    checkpoints = ModelCheckpoint(dirpath=args.out / "checkpoints", save_last=True)

    trainer = pl.Trainer(
        strategy=strategy,
        callbacks=[watcher, checkpoints],
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        precision=args.precision or ("32-true" if on_cpu else "bf16-mixed"),
        max_steps=args.steps,
        check_val_every_n_epoch=None,  # count val_check_interval in optimizer steps, across epochs
        val_check_interval=args.steps,  # validate once, at the end
        limit_val_batches=2,
        log_every_n_steps=max(1, min(10, args.steps)),
        logger=CSVLogger(args.out, name="logs"),
        default_root_dir=args.out,
        enable_model_summary=False,
    )
    model = GPTModule(preset=args.preset, seq_len=args.seq_len, learning_rate=3e-3,
                      warmup_steps=min(10, args.steps // 4), lr_decay_steps=args.steps)
    data = TextDataModule(seq_len=args.seq_len, batch_size=args.global_batch)
    trainer.fit(model, data, ckpt_path=args.resume)

    if trainer.is_global_zero:  # every rank runs this script; one of them reports
        last = checkpoints.last_model_path or checkpoints.best_model_path
        metrics = trainer.callback_metrics
        names = ("train_loss_step", "train_loss_epoch", "val_loss")
        losses = ", ".join(f"{name} {float(metrics[name]):.3f}" for name in names if name in metrics)
        print(f"\ntrained to step {trainer.global_step}: {losses}")
        print(f"checkpoint: {last}  (a sharded directory; resume with --resume {last})")
        print(f"plan: {args.out / 'plan.json'}  profiled cluster: {args.out / 'cluster.yaml'}  "
              f"logs: {trainer.logger.log_dir}")


if __name__ == "__main__":
    main()
