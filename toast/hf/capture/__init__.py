"""toast.hf.capture.states."""
