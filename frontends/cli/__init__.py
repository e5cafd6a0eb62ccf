"""The `ember` command line: one subcommand per module of this package, each providing
add_arguments() and main(). The commands are application code: they use the compiler through
`ember.frontends`' public names and the training layer (`ember.frontends.training`).

Ordinary mistakes (a bad flag value, an unusable path, a missing compiler) end in one line,
``ember <command>: error: ...`` on stderr and exit status 2; ``--debug`` (or ``EMBER_DEBUG=1``)
lets the traceback through instead. Ctrl-C before training has started exits quietly with 130.
A failure of the machine rather than of the arguments (a full disk, an unwritable file found
only when written, memory a step's plan cannot get) is one line too, with exit status 1.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import os
import sys

# subcommand -> (module under ember.frontends.cli, one-line help)
COMMANDS = {
    "mnist": ("mnist", "train an MNIST model (cnn, mlp, lenet5, resnet8) with a compiled step (the main job)"),
    "plot": ("plot", "plot loss and accuracy curves from `ember mnist --metrics-file` JSON lines"),
    "align": ("align", "train ember and PyTorch side by side from the same weights and compare them"),
    "bench": ("bench", "time ember's MNIST training step against PyTorch in one run"),
    "tune": ("tune", "measure every candidate kernel of models' steps on this device and keep the fastest"),
    "kernels": ("kernels", "write the generated sources of a model's steps for a device (no compiler or GPU needed)"),
    "launch": ("launch", "start the ranks of a data-parallel job (RANK, WORLD_SIZE, ...: the torchrun contract)"),
    "export-metrics": ("export", "replay a `--metrics-file` JSON-lines file into an experiment tracker (SwanLab)"),
}


def _version() -> str:
    try:
        return importlib.metadata.version("ember")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where its help already says it (or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command) if command else None
    return None


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--")]


def _command_of(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def _dashes(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """torchrun's and PyTorch scripts' underscore spellings (`--nproc_per_node`, `--batch_size`)
    as ember's (`--nproc-per-node`): a token is respelled only where the dashed form is an option
    of its command, and nothing after a bare `--` (a launched command's own arguments)."""
    sub = _subparser(parser, _command_of(argv))
    known = set(_options(parser)) | set(_options(sub) if sub is not None else ())
    out, passthrough = [], False
    for token in argv:
        if token == "--":
            passthrough = True
        if not passthrough and token.startswith("--") and "_" in token:
            name, eq, value = token.partition("=")
            dashed = name.replace("_", "-")
            if dashed in known:
                token = dashed + eq + value
        out.append(token)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ember: a graph compiler for training small neural networks",
                                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"ember {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error (also: EMBER_DEBUG=1)")
    # SUPPRESS: a subcommand that is not given --debug must not reset the top-level one
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback of an error (also: EMBER_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, parents=[common], formatter_class=_HelpFormatter)
        importlib.import_module(f"{__name__}.{module}").add_arguments(p)
    return parser


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean the user has something to fix, not that ember has a bug."""
    from ember.codegen.compiler import CacheDirError, CompilerNotFoundError

    from ember.frontends.checkpoint import CheckpointError
    from ..training.metrics import MetricsError
    from .cli_checks import UsageError
    return UsageError, CompilerNotFoundError, CacheDirError, CheckpointError, MetricsError


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = _dashes(parser, list(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's own usage, and the closest spelling of what was meant
        sub = _subparser(parser, args.command) or parser
        flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
        close = difflib.get_close_matches(flag.replace("_", "-"), _options(sub), n=1, cutoff=0.6)
        sub.error(f"unrecognized arguments: {' '.join(unknown)}" + (f"; did you mean {close[0]}?" if close else ""))
    if args.command is None:
        parser.print_help()
        return 2
    debug = args.debug or os.environ.get("EMBER_DEBUG", "") not in ("", "0")
    module = importlib.import_module(f"{__name__}.{COMMANDS[args.command][0]}")
    # a command's named recipe (`ember mnist --recipe speedrun`) supplies defaults: parsed again
    # with them, every option given on the command line still wins
    defaults = module.recipe_defaults(args) if hasattr(module, "recipe_defaults") else None
    if defaults:
        sub = _subparser(parser, args.command)
        sub.set_defaults(**defaults)
        args = parser.parse_args(argv)
    try:
        return module.main(args)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"\nember {args.command}: interrupted", file=sys.stderr)
        return 130
    except _user_errors() as e:
        if debug:
            raise
        print(f"ember {args.command}: error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:
        if debug:
            raise
        print(f"ember {args.command}: error: {e or 'out of memory'}", file=sys.stderr)
        return 1
    except OSError as e:
        if debug or e.errno is None:  # no errno: not the system refusing, so likely a bug of ours
            raise
        from .cli_checks import describe_os_error
        where = f"{os.fspath(e.filename)}: " if e.filename is not None else ""
        print(f"ember {args.command}: error: {where}{describe_os_error(e)}", file=sys.stderr)
        return 1


__all__ = ["COMMANDS", "build_parser", "main"]
