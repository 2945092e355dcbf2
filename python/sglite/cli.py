"""The command line: `sglite serve [flags]`, `python -m sglite [flags]` and
`python -m sglite.launch_server [flags]` all start the HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from sglite.config import ServerArgs
from sglite.unsupported_flags import drop_no_ops, find_unsupported, help_epilog
from sglite.version import __version__


def build_parser(prog: str = "sglite serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over HTTP (SGLang-native /generate and an "
        "OpenAI-compatible /v1 API). With no --model-path, serves SmolLM2-135M-Instruct.",
        epilog=help_epilog(),
    )
    parser.add_argument("--version", action="version", version=f"sglite {__version__}")
    ServerArgs.add_cli_args(parser)
    # SGLang's short spelling of --tp-size (its docs use `--tp 2`)
    parser.add_argument(
        "--tp", dest="tp_size", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    # and of --dp-size (`--dp 2`, `--data-parallel-size 2`)
    for alias in ("--dp", "--data-parallel-size"):
        parser.add_argument(
            alias, dest="dp_size", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    # and of --ep-size
    for alias in ("--ep", "--expert-parallel-size"):
        parser.add_argument(
            alias, dest="ep_size", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    # SGLang's short spelling of --enable-hierarchical-cache
    parser.add_argument(
        "--enable-hicache",
        dest="enable_hierarchical_cache",
        action="store_true",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    return parser


def parse_server_args(argv: list[str], prog: str = "sglite serve") -> ServerArgs:
    """ServerArgs from a command line; exits with status 2 and a message on a bad one
    (an SGLang flag sglite does not support is named as such)."""
    parser = build_parser(prog)
    argv = drop_no_ops(argv, parser._option_string_actions)
    problem = find_unsupported(argv, parser._option_string_actions)
    if problem is not None:
        _exit_usage(prog, problem)
    ns = parser.parse_args(argv)
    try:
        return ServerArgs.from_cli_args(ns)
    except ValueError as e:
        _exit_usage(prog, str(e))


def _exit_usage(prog: str, message: str) -> NoReturn:
    """The message alone (the usage line lists every flag: it would bury it), status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def serve(argv: list[str], prog: str = "sglite serve") -> int:
    """Parse server flags and run the server until it stops; returns the exit code."""
    from sglite.launcher import StartupError, launch_server

    server_args = parse_server_args(argv, prog)
    try:
        return launch_server(server_args)
    except StartupError as e:
        logging.getLogger("sglite").error("%s", e)
        return 1
    except KeyboardInterrupt:
        return 0


def main(argv: list[str] | None = None) -> int:
    """Console script `sglite`: `sglite serve [flags]` (the subcommand may be omitted)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        argv = argv[1:]
    elif argv and not argv[0].startswith("-"):
        print(
            f"sglite: unknown command {argv[0]!r}; usage: sglite serve [flags] "
            "(see sglite serve --help)",
            file=sys.stderr,
        )
        return 2
    return serve(argv)
