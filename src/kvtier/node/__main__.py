"""`python -m kvtier.node`: see kvtier.node.cli."""

import sys

from kvtier.node.cli import main

if __name__ == "__main__":
    sys.exit(main())
