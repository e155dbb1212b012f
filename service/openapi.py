"""Writes the service's OpenAPI document to ``openapi.json`` at the repo root.

    python -m optiremat.service.openapi            # regenerate openapi.json
    python -m optiremat.service.openapi --check    # exit 1 when openapi.json is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from optiremat.service.api.main import create_app
from optiremat.service.api.openapi import render
from optiremat.service.core.config import Settings

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "openapi.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m optiremat.service.openapi",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument("--path", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args(argv)
    text = render(create_app(Settings()))
    if args.check:
        if not args.path.exists() or args.path.read_text() != text:
            print(f"{args.path} is stale: run python -m optiremat.service.openapi", file=sys.stderr)
            return 1
        return 0
    args.path.write_text(text)
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
