"""toast.hf.data."""
