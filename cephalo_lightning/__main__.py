"""``python -m cephalo_lightning <command>``: plan | profile | demo | fit | validate | test | predict."""

from __future__ import annotations

import sys

USAGE = """usage: python -m cephalo_lightning <command> [args]

commands:
  plan CLUSTER_FILE --global-batch-size B   plan a cluster offline (torch-free)
  demo                                      train the small GPT on an emulated heterogeneous cluster
  fit | validate | test | predict           LightningCLI (same as `cephalo-train`; --config quickstart
                                            is the packaged quickstart config)
  profile --config C.yaml [-o cluster.yaml] profile every rank of a configured run into a cluster file
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "plan":
        from cephalo_lightning.planner.cli import main as plan_main

        return plan_main(rest)
    if command == "demo":
        from cephalo_lightning.demo.run import main as demo_main

        return demo_main(rest)
    if command == "profile":
        from cephalo_lightning.cli import profile_main

        return profile_main(rest)
    if command in ("fit", "validate", "test", "predict"):
        from cephalo_lightning.cli import main as cli_main

        return cli_main([command, *rest])
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
