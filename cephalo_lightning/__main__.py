"""``python -m cephalo_lightning <command>``: plan | profile | demo | fit | validate | test | predict | consolidate | export | lighthouse."""

from __future__ import annotations

import sys

from cephalo_lightning._common.errors import CephaloError, refused
from cephalo_lightning._common.help_text import PlainHelpFormatter

USAGE = """usage: python -m cephalo_lightning <command> [args]

commands:
  plan CLUSTER_FILE --global-batch-size B   plan a cluster offline (torch-free)
  demo                                      train the small GPT on an emulated heterogeneous cluster
  fit | validate | test | predict           LightningCLI (same as cephalo-train; --config quickstart
                                            is the packaged quickstart config)
  profile --config C.yaml [-o cluster.yaml] profile every rank of a configured run into a cluster file
  consolidate DIR [-o model.ckpt]           one ordinary Lightning checkpoint file from a sharded one
  export DIR --hf OUT                       a Hugging Face save_pretrained directory (safetensors) from a
                                            sharded checkpoint
  lighthouse [--bind HOST:PORT]             torchft's lighthouse for CephaloStrategy(fault_tolerance=True):
                                            the quorum every replica group asks each step
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        return _run(argv[0], argv[1:])
    except CephaloError as err:
        return refused(err)


def _run(command: str, rest: list[str]) -> int:
    if command == "plan":
        from cephalo_lightning.planner.command import main as plan_main

        return plan_main(rest)
    if command == "demo":
        from cephalo_lightning.demo.run import main as demo_main

        return demo_main(rest)
    if command == "profile":
        from cephalo_lightning.lightning.cli import profile_main

        return profile_main(rest)
    if command == "consolidate":
        return consolidate_main(rest)
    if command == "export":
        return export_main(rest)
    if command == "lighthouse":
        from cephalo_lightning.lighthouse import main as lighthouse_main

        return lighthouse_main(rest)
    if command in ("fit", "validate", "test", "predict"):
        from cephalo_lightning.lightning.cli import main as cli_main

        return cli_main([command, *rest])
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


def consolidate_main(argv: list[str]) -> int:
    """``consolidate DIR [-o FILE]``: verify a sharded checkpoint and write it as one file that
    ``LightningModule.load_from_checkpoint`` / ``torch.load(weights_only=True)`` read, with the
    state dict in its original shapes and the optimizer state as ``torch.optim`` saves it."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m cephalo_lightning consolidate", description=consolidate_main.__doc__,
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    parser.add_argument("-o", "--output", default=None, help="the file to write (default: <checkpoint>.consolidated)")
    args = parser.parse_args(argv)
    from cephalo_lightning.lightning.fit.checkpoint_io import consolidate
    from cephalo_lightning.runtime.checkpoint import CheckpointError

    source = Path(args.checkpoint)
    output = Path(args.output) if args.output else source.with_name(source.name + ".consolidated")
    if output.exists():
        print(f"error: {output} exists; choose another -o or remove it first", file=sys.stderr)
        return 2
    try:
        consolidate(source, output)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {output} ({output.stat().st_size / 2**20:.1f} MiB)")
    return 0


def export_main(argv: list[str]) -> int:
    """``export DIR --hf OUT``: verify a sharded checkpoint and write its Hugging Face model as a
    ``save_pretrained`` directory (config.json, safetensors), read unit by unit, so
    ``from_pretrained(OUT)`` gives the trained weights."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m cephalo_lightning export", description=export_main.__doc__,
                                     formatter_class=PlainHelpFormatter)
    parser.add_argument("checkpoint", help="a sharded checkpoint directory (e.g. checkpoints/last.ckpt)")
    parser.add_argument("--hf", required=True, metavar="OUT", help="the directory to write (must not exist or be empty)")
    parser.add_argument("--config", default=None,
                        help="a config.json or a model directory, for a checkpoint that records no Hugging Face config")
    parser.add_argument("--prefix", default=None,
                        help="the model's attribute path in the LightningModule with a trailing dot (e.g. 'model.'); "
                             "default: what the checkpoint records")
    parser.add_argument("--max-shard-size-mb", type=int, default=2048, help="the largest safetensors file (MiB)")
    parser.add_argument("--no-merge", action="store_true",
                        help="a peft LoRA fit: write the tensors as stored (peft's names, the adapters) instead of "
                             "merging the adapters into the base weights")
    args = parser.parse_args(argv)
    from cephalo_lightning.runtime.checkpoint import CheckpointError
    from cephalo_lightning.runtime.checkpoint.export import export_hf

    try:
        done = export_hf(args.checkpoint, args.hf, config=args.config, prefix=args.prefix,
                         max_shard_bytes=args.max_shard_size_mb * 2**20, merge_lora=not args.no_merge)
    except CheckpointError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {done.output}: {done.tensors} tensors in {len(done.files)} safetensors file(s)"
          + (f"; left out {len(done.skipped)} tensors outside the model (e.g. {done.skipped[0]})" if done.skipped else ""))
    if done.note:
        print(done.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
