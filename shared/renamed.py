"""Old names of renamed classes and moved modules: still served, with a warning."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import Any

RENAMES_DROPPED_IN = "0.3.0"
"""The sparkforge version that stops serving the old names."""


def renamed_attribute(module: str, name: str, renamed: Mapping[str, str]) -> Any:
    """``module``'s new name for ``name``, warning (``FutureWarning``) that the old one goes.

    Call it from a module's ``__getattr__`` (PEP 562), which Python asks only for names the
    module does not define, so the new names cost nothing.

    Args:
        module: The module's ``__name__``.
        name: The name asked for.
        renamed: Old name -> the new name it is served as, in the same module.

    Raises:
        AttributeError: ``name`` is neither defined nor an old name.
    """
    new = renamed.get(name)
    if new is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(f"{module}.{name} is renamed {new}; the old name is dropped in sparkforge "
                  f"{RENAMES_DROPPED_IN}", FutureWarning, stacklevel=3)
    return getattr(sys.modules[module], new)


def renamed_module(old: str, new: str) -> ModuleType:
    """Module ``new``, warning (``FutureWarning``) that its old path ``old`` goes.

    A moved module's old file is then the one line ``sys.modules[__name__] =
    renamed_module(__name__, "new.path")``, so ``from old import Name`` gives the very same
    objects as ``from new import Name``.
    """
    warnings.warn(f"{old} is renamed {new}; the old module path is dropped in sparkforge "
                  f"{RENAMES_DROPPED_IN}", FutureWarning, stacklevel=3)
    return importlib.import_module(new)
