"""Hugging Face glue, method-agnostic (torch + transformers): block
discovery, calibration passes, capture into moments or row samples, model
surgery, distributed reductions and parameter counting.

- :mod:`toast.hf.blocks`: find the block list, a block's projections, the head;
- :mod:`toast.hf.calibration`: :class:`Calibration`, the options of every pass
  (torch-free, so configs build without importing torch);
- :mod:`toast.hf.capture`: hooks → moments (:func:`capture_moments`);
- :mod:`toast.hf.rows`: hooks → a bounded, disk-backed row sample;
- :mod:`toast.hf.torch_moments`: moments formed on an accelerator with torch;
- :mod:`toast.hf.surgery`: replace or remove spans of blocks in place;
- :mod:`toast.hf.distributed`: sums over ``torch.distributed`` ranks;
- :mod:`toast.hf.params`: the parameter counter;
- :mod:`toast.hf.text`: raw text (files, lists, datasets, chat rows) → batches;
- :mod:`toast.hf.quality`: measured held-out quality (perplexity, accuracy,
  output cosine) and plain removal of spans by hooks;
- :mod:`toast.hf.checkpoint`: a safetensors checkpoint folder read tensor by tensor;
- :mod:`toast.hf.sequential`: calibration block by block from disk
  (:class:`DiskModel`, :func:`stream_blocks`), for models bigger than memory;
- :mod:`toast.hf.disk_moments`: moments from that stream;
- :mod:`toast.hf.disk_quality`: held-out quality measured block by block from
  disk, with blocks skipped or changed as they load (:class:`SequentialEvaluator`);
- :mod:`toast.hf.budget`: whether a checkpoint fits the memory budget.
"""

from toast._lazy import lazy_getattr

__all__ = [
    "BlockParts",
    "BlockStack",
    "Calibration",
    "Projection",
    "block_parts",
    "count_params",
    "find_blocks",
    "find_head",
    "capture_moments",
    "capture_rows",
    "RowSample",
    "stream_states",
    "replace_spans",
    "remove_blocks",
    "all_reduce_moments",
    "TextData",
    "as_batches",
    "Evaluator",
    "Quality",
    "skipped_blocks",
    "Checkpoint",
    "DiskModel",
    "stream_blocks",
    "capture_moments_from_disk",
    "memory_plan",
]

__getattr__ = lazy_getattr(
    __name__,
    {
        "BlockParts": "toast.hf.blocks",
        "BlockStack": "toast.hf.blocks",
        "Projection": "toast.hf.blocks",
        "block_parts": "toast.hf.blocks",
        "find_blocks": "toast.hf.blocks",
        "find_head": "toast.hf.blocks",
        "Calibration": "toast.hf.calibration",
        "count_params": "toast.hf.params",
        "capture_moments": "toast.hf.capture",
        "stream_states": "toast.hf.capture",
        "capture_rows": "toast.hf.rows",
        "RowSample": "toast.hf.rows",
        "replace_spans": "toast.hf.surgery",
        "remove_blocks": "toast.hf.surgery",
        "all_reduce_moments": "toast.hf.distributed",
        "TextData": "toast.hf.text",
        "as_batches": "toast.hf.text",
        "Evaluator": "toast.hf.quality",
        "Quality": "toast.hf.quality",
        "skipped_blocks": "toast.hf.quality",
        "Checkpoint": "toast.hf.checkpoint",
        "DiskModel": "toast.hf.sequential",
        "stream_blocks": "toast.hf.sequential",
        "capture_moments_from_disk": "toast.hf.disk_moments",
        "memory_plan": "toast.hf.budget",
    },
)
