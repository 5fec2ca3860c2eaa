"""Moved to :mod:`sparkforge.trainer.run_folder.checkpoints` (this path goes in 0.3.0)."""

import sys

from sparkforge.shared.renamed import renamed_module

sys.modules[__name__] = renamed_module(__name__, "sparkforge.trainer.run_folder.checkpoints")
