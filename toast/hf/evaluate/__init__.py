"""toast.hf.evaluate."""
