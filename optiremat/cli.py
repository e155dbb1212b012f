"""The ``optiremat`` command line.

Each subcommand imports what it needs when it runs, so ``optiremat serve`` never
loads JAX and ``optiremat --help`` stays instant.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from pydantic import ValidationError

from optiremat.commands import (  # imports nothing heavy: commands import lazily
    SIZE_OPTIONS,
    add_commands,
)


class Parser(argparse.ArgumentParser):
    """A usage error is two lines: what is wrong, and where the usage is."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n"
                     f"run '{self.prog} --help' for its arguments\n")


def _settings_error(command: str, exc: ValidationError) -> str:
    from optiremat.service.core.config import Settings
    from optiremat.solver.validation_message import validation_message

    flags = {"host": " (--host)", "port": " (--port)"}
    names = {field: f"OPTIREMAT_{field.upper()}{flags.get(field, '')}"
             for field in Settings.model_fields}
    return f"optiremat {command}: invalid setting {validation_message(exc, names)}"


def _serve(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from optiremat.service.api.main import serve
    from optiremat.service.core.config import Settings

    overrides = {name: value for name, value in (("host", args.host), ("port", args.port))
                 if value is not None}
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        print(_settings_error("serve", exc), file=sys.stderr)
        return 2
    serve(settings)
    return 0


def _worker(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from optiremat.service.core.config import Settings

    try:
        settings = Settings()
    except ValidationError as exc:
        print(_settings_error("worker", exc), file=sys.stderr)
        return 2
    if not settings.redis_url:
        print("optiremat worker: set OPTIREMAT_REDIS_URL (e.g. redis://localhost:6379/0)",
              file=sys.stderr)
        return 2
    from optiremat.service.core.rq_worker import work

    return work(settings, burst=args.burst, sync_only=args.sync_only)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
    worker.add_argument("--sync-only", action="store_true",
                        help="take only solves a client waits on (POST /v1/solve, frontiers), "
                             "never jobs: run a few such workers so that jobs never starve them")
    worker.set_defaults(run=_worker)
    add_commands(parser, commands)
    return parser


# A value such as '-5GiB' (argparse takes only plain negative numbers as values).
_NEGATIVE_LOOKING = re.compile(r"^-[0-9.]")


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--budget -5GiB`` as ``--budget=-5GiB``, so that the value's own check answers
    (a budget must be positive), not argparse's 'expected one argument'."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1] in SIZE_OPTIONS and _NEGATIVE_LOOKING.match(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(_join_negative_values(argv))
    run: Callable[[argparse.Namespace], int] = args.run
    return run(args)

