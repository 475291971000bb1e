"""The ``toast`` command line."""

from toast.cli.main import main, program

__all__ = ["main", "program"]
