"""Hugging Face glue, method-agnostic (torch + transformers): block
discovery, calibration passes, capture into moments or row samples, model
surgery, distributed reductions and parameter counting.

- :mod:`toast.hf.model.blocks`: find the block list, a block's projections, the head;
- :mod:`toast.hf.data.calibration`: :class:`Calibration`, the options of every pass
  (torch-free, so configs build without importing torch);
- :mod:`toast.hf.capture.states`: hooks → moments (:func:`capture_moments`);
- :mod:`toast.hf.capture.rows`: hooks → a bounded, disk-backed row sample;
- :mod:`toast.hf.capture.torch_moments`: moments formed on an accelerator with torch;
- :mod:`toast.hf.model.surgery`: replace or remove spans of blocks in place;
- :mod:`toast.hf.capture.distributed`: sums over ``torch.distributed`` ranks;
- :mod:`toast.hf.model.params`: the parameter counter;
- :mod:`toast.hf.data.text`: raw text (files, lists, datasets, chat rows) → batches;
- :mod:`toast.hf.evaluate.quality`: measured held-out quality (perplexity, accuracy,
  output cosine) and plain removal of spans by hooks;
- :mod:`toast.hf.model.checkpoint`: a safetensors checkpoint folder read tensor by tensor;
- :mod:`toast.hf.capture.sequential`: calibration block by block from disk
  (:class:`DiskModel`, :func:`stream_blocks`), for models bigger than memory;
- :mod:`toast.hf.capture.disk_moments`: moments from that stream;
- :mod:`toast.hf.evaluate.from_disk`: held-out quality measured block by block from
  disk, with blocks skipped or changed as they load (:class:`SequentialEvaluator`);
- :mod:`toast.hf.capture.budget`: whether a checkpoint fits the memory budget.
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
        "BlockParts": "toast.hf.model.blocks",
        "BlockStack": "toast.hf.model.blocks",
        "Projection": "toast.hf.model.blocks",
        "block_parts": "toast.hf.model.blocks",
        "find_blocks": "toast.hf.model.blocks",
        "find_head": "toast.hf.model.blocks",
        "Calibration": "toast.hf.data.calibration",
        "count_params": "toast.hf.model.params",
        "capture_moments": "toast.hf.capture.states",
        "stream_states": "toast.hf.capture.states",
        "capture_rows": "toast.hf.capture.rows",
        "RowSample": "toast.hf.capture.rows",
        "replace_spans": "toast.hf.model.surgery",
        "remove_blocks": "toast.hf.model.surgery",
        "all_reduce_moments": "toast.hf.capture.distributed",
        "TextData": "toast.hf.data.text",
        "as_batches": "toast.hf.data.text",
        "Evaluator": "toast.hf.evaluate.quality",
        "Quality": "toast.hf.evaluate.quality",
        "skipped_blocks": "toast.hf.evaluate.quality",
        "Checkpoint": "toast.hf.model.checkpoint",
        "DiskModel": "toast.hf.capture.sequential",
        "stream_blocks": "toast.hf.capture.sequential",
        "capture_moments_from_disk": "toast.hf.capture.disk_moments",
        "memory_plan": "toast.hf.capture.budget",
    },
)
