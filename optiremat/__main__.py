"""``python -m optiremat``: the ``optiremat`` command line."""

import sys

from optiremat.cli import main

sys.exit(main())
