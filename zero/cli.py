"""Command line: ``zero demo`` (also ``python -m zero demo``)."""

from __future__ import annotations

import argparse
import sys

from zero import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero", description="ZeRO data parallelism for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo", help="train a small GPT on CPU ranks at stages 0-2 and print losses and per-rank memory"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
