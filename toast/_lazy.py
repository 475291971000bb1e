"""Lazy package attributes (PEP 562), so that importing a package, or a
torch-free module inside it such as a config, does not import torch.

``__getattr__ = lazy_getattr(__name__, {"name": "package.module", ...})``
in a package's ``__init__`` resolves each public name from its module on
first use and caches it in the package's namespace.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_getattr"]


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` resolving ``names`` (public name → module;
    a name mapped to ``package.name`` is that submodule itself)."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(module)
        # a subpackage maps to itself: ``toast.hf`` without ``import toast.hf``
        value = imported if module == f"{package}.{name}" else getattr(imported, name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
