"""`python -m sglite.launch_server --model-path P ...`: SGLang's way to start the server."""

from __future__ import annotations

import sys

from sglite.cli import serve

if __name__ == "__main__":
    sys.exit(serve(sys.argv[1:], prog="python -m sglite.launch_server"))
