"""The command-line help of the options several methods' configs share.

Every config says what its options mean on the command line in its own
``HELP`` (``toast compress --method NAME --help`` reads nothing else); a
text that means the same in every config with that field lives here once,
since the methods import no module of one another. Torch-free, as the
configs are: ``--help`` never imports torch.
"""

from __future__ import annotations

__all__ = ["CHECK_FRACTION_HELP", "FALLBACK_HELP", "NUM_BLOCKS_HELP"]

NUM_BLOCKS_HELP = "blocks to remove"
CHECK_FRACTION_HELP = (
    "fraction of calibration batches held out to check each fit against plain removal "
    "(at least the last batch when there are 2 or more; 0: none, the papers' protocol)"
)
FALLBACK_HELP = "keep a fit even where plain removal measures better on held-out batches"
