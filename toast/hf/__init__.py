"""Hugging Face glue, method-agnostic (torch + transformers), by role:

- :mod:`toast.hf.model`: the model's structure and its edits: ``blocks``
  (the block list, a block's projections, the head), ``surgery`` (replace or
  remove spans in place), ``params`` (the parameter counter),
  ``checkpoint`` (a safetensors folder read tensor by tensor);
- :mod:`toast.hf.data`: ``text`` (raw text, files, datasets, chat rows →
  batches), ``calibration`` (:class:`Calibration`, the options of every pass,
  torch-free), ``progress``;
- :mod:`toast.hf.capture`: the pipelines that stream states: in memory
  (``states``: hooks → moments, :func:`capture_moments`; ``rows``;
  ``torch_moments``; ``distributed``; ``massive``), block by block from a
  checkpoint (``sequential``: :class:`DiskModel`, :func:`stream_blocks`;
  ``disk_moments``), and ``budget``, which chooses between them;
- :mod:`toast.hf.evaluate`: ``quality`` (held-out perplexity, accuracy or
  output cosine; plain removal by hooks), ``from_disk`` (the same block by
  block, :class:`SequentialEvaluator`), ``check`` (a fit against plain
  removal on calibration batches kept out of the fit).
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
        "DiskModel": "toast.hf.capture.disk_model",
        "stream_blocks": "toast.hf.capture.sequential",
        "capture_moments_from_disk": "toast.hf.capture.disk_moments",
        "memory_plan": "toast.hf.capture.budget",
    },
)
