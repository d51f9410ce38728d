"""`python -m detokbench`: the same as scripts/bench.py."""

import sys

from .cli import main

sys.exit(main())
