"""`python -m detokbench CMD [args]`: see detokbench.commands."""

import sys

from .commands import main

if __name__ == "__main__":
    sys.exit(main())
