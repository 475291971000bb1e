"""Hugging Face glue, method-agnostic (torch + transformers): block
discovery, calibration passes, capture into moments or row samples, model
surgery, distributed reductions and parameter counting.

- :mod:`toast.hf.blocks`: find the block list, a block's projections, the head;
- :mod:`toast.hf.calibration`: :class:`Calibration`, the options of every pass;
- :mod:`toast.hf.capture`: hooks → moments (:func:`capture_moments`);
- :mod:`toast.hf.rows`: hooks → a bounded, disk-backed row sample;
- :mod:`toast.hf.torch_moments`: moments formed on an accelerator with torch;
- :mod:`toast.hf.surgery`: replace or remove spans of blocks in place;
- :mod:`toast.hf.distributed`: sums over ``torch.distributed`` ranks;
- :mod:`toast.hf.params`: the parameter counter.
"""

from toast.hf.blocks import BlockParts, BlockStack, Projection, block_parts, find_blocks, find_head
from toast.hf.calibration import Calibration
from toast.hf.params import count_params

__all__ = [
    "BlockParts",
    "BlockStack",
    "Calibration",
    "Projection",
    "block_parts",
    "count_params",
    "find_blocks",
    "find_head",
]
