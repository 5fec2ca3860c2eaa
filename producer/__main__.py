"""``python -m sparkforge.producer <command> ...``: the producer CLI without the console script."""

import sys

from sparkforge.producer.cli import main

sys.exit(main())
