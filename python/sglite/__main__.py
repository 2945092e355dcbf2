"""`python -m sglite [serve] [flags]`: the server command line."""

from __future__ import annotations

import sys

from sglite.cli import main

if __name__ == "__main__":
    sys.exit(main())
