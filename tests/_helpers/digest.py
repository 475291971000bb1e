"""A digest of what a model computes with: its tensors and configs."""

from __future__ import annotations

import hashlib
import json


def model_digest(model) -> str:
    """SHA-256 of a model's tensors (by name), config and generation config."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    config = {k: v for k, v in model.config.to_dict().items() if k != "_name_or_path"}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        h.update(json.dumps(generation.to_dict(), sort_keys=True, default=str).encode())
    return h.hexdigest()
