"""``python -m cephalo_lightning plan CLUSTER_FILE --global-batch-size B``: plan a cluster offline."""

from __future__ import annotations

import argparse
import sys

from cephalo_lightning.planner.cluster import load_cluster
from cephalo_lightning.planner.errors import PlanningError
from cephalo_lightning.planner.plan import PLAN_MODES
from cephalo_lightning.planner.solver import STRATEGIES, plan


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cephalo_lightning plan",
        description="Choose every GPU's batch, micro-batches and state share for a heterogeneous cluster "
                    "(torch-free; figures are predictions of the cost model).",
    )
    parser.add_argument("cluster_file", help="cluster file (YAML or JSON): model, settings, devices")
    parser.add_argument("-b", "--global-batch-size", type=int, required=True, help="samples per optimizer step")
    parser.add_argument("--mode", choices=PLAN_MODES, default="layered",
                        help="layered: micro-batch count per rank (default); uniform: one count for all")
    parser.add_argument("--strategy", choices=STRATEGIES, default="cephalo",
                        help="plan with cephalo (default) or output a baseline plan")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.add_argument("-o", "--output", help="write the plan JSON here (atomically)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; 0 on success, 2 on bad input (message on stderr)."""
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the usage and the problem
        return int(exit_.code or 0)
    try:
        cluster = load_cluster(args.cluster_file)
        result = plan(cluster, args.global_batch_size, mode=args.mode, strategy=args.strategy)
        if args.output:
            result.save(args.output)
    except PlanningError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(result.to_json())
    else:
        from cephalo_lightning.planner.report import print_plan

        print_plan(result)
        if args.output:
            print(f"plan written to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
