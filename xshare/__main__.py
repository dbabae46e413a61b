"""``python -m xshare ...``: the same command as the ``xshare`` console script."""

import sys

from xshare.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
