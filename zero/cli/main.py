"""Command line: ``zero demo``, ``zero estimate``, ``zero report`` and ``zero consolidate``
(also ``python -m zero ...``)."""

from __future__ import annotations

import argparse
import sys

from zero.checkpoint.consolidate import consolidate
from zero.cli import demo
from zero.cli import estimate as estimate_cli
from zero.cli import report as report_cli
from zero.cli.gpt_options import gpt_config
from zero.cli.types import SIZE_HELP, memory_size
from zero.precision import DTYPES
from zero.sizes import KiB, TiB, size_range
from zero.version import __version__

SHARD_SIZES = (KiB, TiB)  # --max-shard-size's accepted range (inclusive)


class Parser(argparse.ArgumentParser):
    """Errors in one line, ``zero estimate: error: ...``, with exit code 2 (argparse's own prints the
    whole usage first); its subcommands' parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="zero", description="ZeRO data parallelism for PyTorch")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version and exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                     help="run zero COMMAND --help for its options")
    demo_parser = commands.add_parser(
        "demo", help="train a small GPT on CPU ranks at stages 0-3 and print losses and per-rank memory"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main, check=demo.check, parser=demo_parser)
    estimate_parser = commands.add_parser(
        "estimate", help="per-rank peak memory of a GPT for every stage/offload/checkpointing/micro-batch; what fits"
    )
    estimate_cli.add_arguments(estimate_parser)
    estimate_parser.set_defaults(run=estimate_cli.main, check=gpt_config, parser=estimate_parser)
    report_parser = commands.add_parser(
        "report", help="profile a few training steps of a GPT on CPU ranks: memory by category, module and phase"
    )
    report_cli.add_arguments(report_parser)
    report_parser.set_defaults(run=report_cli.main, check=report_cli.check, parser=report_parser)
    consolidate_parser = commands.add_parser(
        "consolidate", help="export a checkpoint saved by zero.save_checkpoint to safetensors or a torch state_dict"
    )
    _consolidate_arguments(consolidate_parser)
    consolidate_parser.set_defaults(run=_consolidate, check=None, parser=consolidate_parser)
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
        "--max-shard-size", type=memory_size(*SHARD_SIZES), default="5GB", metavar="SIZE",
        help=f"largest safetensors file in a directory export, {size_range(*SHARD_SIZES)} (default 5GB; {SIZE_HELP})",
    )


def _consolidate(args: argparse.Namespace) -> int:
    try:
        consolidate(args.checkpoint, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size)
    except ValueError as err:  # a checkpoint it cannot export: the library's message names the cause
        print(f"zero consolidate: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a path it cannot read or write (no such file, not a directory, permissions, disk full)
        where = f"{err.filename}: " if err.filename is not None else ""
        print(f"zero consolidate: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what demo and report pass on to the ranks they launch
    if args.check is not None:
        try:
            args.check(args)  # what argparse cannot check alone: a one-line error, exit code 2, no traceback
        except ValueError as err:
            args.parser.error(str(err))
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
