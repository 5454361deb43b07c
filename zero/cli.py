"""Command line: ``zero demo``, ``zero estimate`` and ``zero report`` (also ``python -m zero ...``)."""

from __future__ import annotations

import argparse
import sys

from zero import demo
from zero.profiler import estimate_cli, report_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero", description="ZeRO data parallelism for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="train a small GPT on CPU ranks at stages 0-3 and print losses and per-rank memory"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main)
    estimate_parser = commands.add_parser(
        "estimate", help="per-rank peak memory of a GPT for every stage/offload/checkpointing/micro-batch; what fits"
    )
    estimate_cli.add_arguments(estimate_parser)
    estimate_parser.set_defaults(run=estimate_cli.main)
    report_parser = commands.add_parser(
        "report", help="profile a few training steps of a GPT on CPU ranks: memory by category, module and phase"
    )
    report_cli.add_arguments(report_parser)
    report_parser.set_defaults(run=report_cli.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
