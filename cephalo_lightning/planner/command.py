"""``python -m cephalo_lightning plan CLUSTER_FILE --global-batch-size B``: plan a cluster offline.

``python -m cephalo_lightning plan convert LATENCIES MEMORY --model M --num-layers L --gpus ...``
turns the Cephalo release's profile files into a cluster file (:mod:`.convert`), and plans it too
when given ``--global-batch-size``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from cephalo_lightning._common.help_text import PlainHelpFormatter
from cephalo_lightning._common.vocabulary import Grouping, Planner, Schedule, values_of
from cephalo_lightning.planner.planning import plan
from cephalo_lightning.planner.schema.cluster import cluster_from_dict, load_cluster, save_cluster
from cephalo_lightning.planner.schema.files import check_writable, write_error
from cephalo_lightning.planner.schema.planning_error import PlanningError
from cephalo_lightning.planner.search.input_checks import PLANNERS


class _DeprecatedAlias(argparse.Action):
    """``--strategy``, the old name of ``--planner`` (a strategy is Lightning's word for how a model is
    distributed): still accepted, hidden from the help, and named as deprecated when used."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(f"warning: {option_string} is deprecated; write --planner {values}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _add_plan_options(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("-b", "--global-batch-size", type=int, required=required, help="samples per optimizer step")
    parser.add_argument("--mode", choices=values_of(Schedule), default=Schedule.LAYERED,
                        help="layered: micro-batch count per rank (default); uniform: one count for all")
    parser.add_argument("--planner", choices=PLANNERS, default=Planner.CEPHALO,
                        help="plan with cephalo (default) or output a baseline plan")
    parser.add_argument("--strategy", dest="planner", choices=PLANNERS, action=_DeprecatedAlias, help=argparse.SUPPRESS)
    parser.add_argument("--groupings", default=None, metavar="NAMES",
                        help=f"comma-separated shard groupings to weigh, of {','.join(Grouping)} (default: all)")
    parser.add_argument("--no-pipelines", dest="pipelines", action="store_false",
                        help="weigh no pipelined plans (default: weigh them, layered mode)")
    parser.add_argument("--no-subsets", dest="subsets", action="store_false",
                        help="weigh no plans that leave devices idle (default: weigh them, layered mode)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    parser.add_argument("-o", "--output", help="write the plan JSON here (atomically)")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="also draw the plan beside the even plan into this image: per-rank batch, micro-batches, "
                             "state share, memory used against the limit and step (needs matplotlib: the plot extra)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cephalo_lightning plan", formatter_class=PlainHelpFormatter,
        description="Choose every GPU's batch, micro-batches and state share for a heterogeneous cluster "
                    "(torch-free; figures are predictions of the cost model). "
                    "To make a cluster file from the Cephalo release's profiles, see: plan convert --help.",
    )
    parser.add_argument("cluster_file", help="cluster file (YAML or JSON): model, settings, devices")
    _add_plan_options(parser, required=True)
    return parser


def _convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cephalo_lightning plan convert", formatter_class=PlainHelpFormatter,
        description="Write a cluster file from the Cephalo release's model_latencies.json and model_memory.json "
                    "(and plan it with --global-batch-size).",
    )
    parser.add_argument("latencies", help="the release's model_latencies.json")
    parser.add_argument("memory", help="the release's model_memory.json")
    parser.add_argument("--model", required=True, help="the model's key in both files, e.g. gpt_2.7b")
    parser.add_argument("--num-layers", type=int, required=True, help="transformer layers of the model")
    parser.add_argument("--gpus", required=True, help="GPUs in rank order with counts, e.g. l4:2,a6000,p40")
    parser.add_argument("--seq-len", help="the sequence-length key (default: the only one)")
    parser.add_argument("--dtype", help="the dtype key, e.g. float16 (default: the only one)")
    parser.add_argument("--cluster", help="the cluster key of model_memory.json (default: the only one)")
    parser.add_argument("--memory-gb", action="append", default=[], metavar="NAME=GB",
                        help="a GPU's memory in GiB (default: the GPU catalog's); repeatable")
    parser.add_argument("--link-bandwidth", metavar="QUANTITY",
                        help="the link inside a node, with its unit, per rank, e.g. '16 GB/s per rank' (the release's "
                             "files have none; a cluster of several GPUs needs it to be planned)")
    parser.add_argument("--inter-node-bandwidth", metavar="QUANTITY",
                        help="the network between nodes, e.g. '10 Gbit/s per link' (with several nodes)")
    parser.add_argument("--cluster-output", default="cluster.yaml",
                        help="the cluster file to write (YAML, or JSON by suffix; default cluster.yaml)")
    _add_plan_options(parser, required=False)
    return parser


def _memory_overrides(values: list[str]) -> dict[str, float]:
    out = {}
    for value in values:
        name, _, gb = value.partition("=")
        try:
            out[name.strip()] = float(gb)
        except ValueError:
            raise PlanningError(f"--memory-gb {value!r}: expected NAME=GB, e.g. p40=22.4") from None
    return out


def _links(args: argparse.Namespace) -> dict[str, str]:
    """The converted file's settings: the bandwidths given on the command line, as written."""
    given = {"link_bandwidth": args.link_bandwidth, "inter_node_bandwidth": args.inter_node_bandwidth}
    return {key: value for key, value in given.items() if value is not None}


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace | int:
    try:
        return parser.parse_args(argv)
    except SystemExit as exit_:  # argparse already printed the usage and the problem
        return int(exit_.code or 0)


def main(argv: list[str] | None = None) -> int:
    """Run the command; 0 on success, 2 on bad input (message on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    converting = bool(argv) and argv[0] == "convert"
    args = _parse(_convert_parser() if converting else _parser(), argv[1:] if converting else argv)
    if isinstance(args, int):
        return args
    try:
        if args.output:
            check_writable(args.output, "-o")
        if args.plot:
            from cephalo_lightning.planner.picture import require_matplotlib

            check_writable(args.plot, "--plot")
            require_matplotlib()  # before the planning, not after it
        if converting:
            check_writable(args.cluster_output, "--cluster-output")
            from cephalo_lightning.planner.schema.convert import convert_release, parse_gpus

            data = convert_release(args.latencies, args.memory, model=args.model, num_layers=args.num_layers,
                                   gpus=parse_gpus(args.gpus), seq_len=args.seq_len, dtype=args.dtype,
                                   cluster=args.cluster, memory_gb=_memory_overrides(args.memory_gb),
                                   settings=_links(args))
            cluster = cluster_from_dict(data)
            try:
                save_cluster(cluster, args.cluster_output)
            except OSError as err:
                raise write_error(args.cluster_output, err, "--cluster-output") from None
            print(f"cluster file written to {args.cluster_output} ({cluster.world_size} GPUs, converted from the "
                  f"Cephalo release's profiles)")
            if args.global_batch_size is None:
                return 0
        else:
            cluster = load_cluster(args.cluster_file)
        groupings = None if args.groupings is None else tuple(g.strip() for g in args.groupings.split(","))
        shapes = args.mode == Schedule.LAYERED and args.planner == Planner.CEPHALO  # where pipelines and subsets run
        result = plan(cluster, args.global_batch_size, mode=args.mode, planner=args.planner, groupings=groupings,
                      pipelines=shapes and args.pipelines, subsets=shapes and args.subsets)
        if args.output:
            try:
                result.save(args.output)
            except OSError as err:
                raise write_error(args.output, err, "-o") from None
        if args.plot:
            from cephalo_lightning.planner.picture import even_plan, save_plan_figure

            try:
                save_plan_figure(result, args.plot, *even_plan(cluster, result))
            except OSError as err:
                raise write_error(args.plot, err, "--plot") from None
    except PlanningError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(result.to_json())
    else:
        from cephalo_lightning.planner.assumptions import assumption_lines
        from cephalo_lightning.planner.report import print_plan

        print_plan(result, cluster, args.output, assumptions=assumption_lines(cluster, result, groupings))
        if cluster.calibration is not None:
            from cephalo_lightning.planner.cost.calibration import describe

            print(f"priced with the file's calibration: {describe(cluster.calibration)}")
        if args.output:
            print(f"plan written to {args.output}")
        if args.plot:
            print(f"picture written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
