"""The ``optiremat`` command line.

Each subcommand imports what it needs when it runs, so ``optiremat serve`` never
loads JAX and ``optiremat --help`` stays instant.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from optiremat.commands import add_commands  # imports nothing heavy: commands import lazily


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from optiremat.service.api.main import serve
    from optiremat.service.core.config import Settings

    overrides = {name: value for name, value in (("host", args.host), ("port", args.port))
                 if value is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(f"optiremat serve: invalid settings (OPTIREMAT_* variables or flags):\n{exc}",
              file=sys.stderr)
        return 2
    serve(settings)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from optiremat.service.core.config import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        print(f"optiremat worker: invalid settings (OPTIREMAT_* variables):\n{exc}",
              file=sys.stderr)
        return 2
    if not settings.redis_url:
        print("optiremat worker: set OPTIREMAT_REDIS_URL (e.g. redis://localhost:6379/0)",
              file=sys.stderr)
        return 2
    from optiremat.service.core.rq_worker import work

    return work(settings, burst=args.burst)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="optiremat",
        description="Optimal activation checkpointing for JAX.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the REST service",
        description="Run the REST service (one process, worker processes, SQLite under "
                    "OPTIREMAT_DATA_DIR). Other settings come from OPTIREMAT_* variables; "
                    "see docs/service.md.",
    )
    serve.add_argument("--host", help="interface to bind (default: OPTIREMAT_HOST, 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port (default: OPTIREMAT_PORT, 8000)")
    serve.set_defaults(run=_serve)

    worker = commands.add_parser(
        "worker",
        help="run a solver worker for the clustered service",
        description="Take solves from the Redis queue at OPTIREMAT_REDIS_URL (cluster mode; "
                    "see docker/README.md), one at a time, until SIGTERM, which lets the "
                    "current solve finish.",
    )
    worker.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    worker.set_defaults(run=_worker)
    add_commands(parser, commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)

