"""``python -m sinkformer ...``: the ``sinkformer`` command (see :mod:`sinkformer.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":  # spawned worker processes import this module as __mp_main__: no second run there
    sys.exit(main())
