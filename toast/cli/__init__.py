"""The ``toast`` command line."""

from toast.cli.main import main

__all__ = ["main"]
