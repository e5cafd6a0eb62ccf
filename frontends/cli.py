"""The `ember` command line: one subcommand per module, each providing add_arguments() and main()."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under ember.frontends, one-line help)
COMMANDS = {
    "mnist": ("train", "train the MNIST CNN or MLP with a compiled step (the main job)"),
    "plot": ("plot", "plot loss and accuracy curves from `ember mnist --metrics-file` JSON lines"),
    "align": ("align", "train ember and PyTorch side by side from the same weights and compare them"),
    "bench": ("bench", "time ember's MNIST training step against PyTorch in one run"),
    "kernels": ("kernels", "write the generated sources of a model's steps for a device (no compiler or GPU needed)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ember: a graph compiler for training small neural networks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(f"ember.frontends.{module}").add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(f"ember.frontends.{COMMANDS[args.command][0]}")
    return module.main(args)


if __name__ == "__main__":
    sys.exit(main())
