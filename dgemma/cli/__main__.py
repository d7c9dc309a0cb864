"""`python -m dgemma.cli`: the same entry point as the `dgemma` command."""

import sys

from . import main

sys.exit(main())
