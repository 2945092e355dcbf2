"""The command line: `sglite serve [flags]`, `python -m sglite [flags]` and
`python -m sglite.launch_server [flags]` all start the HTTP server."""

from __future__ import annotations

import argparse
import logging
import sys

from sglite.config import ServerArgs
from sglite.version import __version__


def build_parser(prog: str = "sglite serve") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve a model over HTTP (SGLang-native /generate and an "
        "OpenAI-compatible /v1 API). With no --model-path, serves SmolLM2-135M-Instruct.",
    )
    parser.add_argument("--version", action="version", version=f"sglite {__version__}")
    ServerArgs.add_cli_args(parser)
    return parser


def serve(argv: list[str], prog: str = "sglite serve") -> int:
    """Parse server flags and run the server until it stops; returns the exit code."""
    from sglite.launcher import StartupError, launch_server

    ns = build_parser(prog).parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(ns)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
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
