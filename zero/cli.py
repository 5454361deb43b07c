"""Command line: ``zero demo``, ``zero estimate``, ``zero report`` and ``zero consolidate`` (also ``python -m zero ...``)."""

from __future__ import annotations

import argparse
import sys

from zero import demo
from zero.consolidate import consolidate
from zero.precision import DTYPES
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
    consolidate_parser = commands.add_parser(
        "consolidate", help="export a checkpoint saved by zero.save_checkpoint to safetensors or a torch state_dict"
    )
    _consolidate_arguments(consolidate_parser)
    consolidate_parser.set_defaults(run=_consolidate)
    return parser


def _consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="the checkpoint directory (it holds metadata.json)")
    parser.add_argument(
        "out",
        help="a directory (model.safetensors, or shards plus model.safetensors.index.json as Hugging Face writes "
        "them), a file ending in .safetensors, or one ending in .pt/.pth/.bin (torch.save of a state_dict)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="cast floating-point tensors (default: as saved)")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file in a directory export (default: 5GB)"
    )


def _consolidate(args: argparse.Namespace) -> int:
    try:
        consolidate(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except (ValueError, FileNotFoundError) as err:
        print(f"zero consolidate: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
