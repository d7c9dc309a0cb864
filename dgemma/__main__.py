"""`python -m dgemma ...`: the `dgemma` command (dgemma/cli/)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
