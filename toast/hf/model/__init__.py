"""toast.hf.model."""
