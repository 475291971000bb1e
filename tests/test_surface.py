"""The top level of ``toast``: a small public surface, the rest in packages."""

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import toast

ROOT = Path(__file__).resolve().parents[1]
MAX_NAMES = 20
SUBPACKAGES = {"accounting", "core", "frontier", "hf", "io", "methods", "translators"}


def _public_non_modules(names) -> set[str]:
    return {
        name
        for name in names
        if not name.startswith("_") and not inspect.ismodule(getattr(toast, name))
    }


def _run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, importing this checkout's toast."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )


def test_the_top_level_has_at_most_twenty_names():
    assert len(toast.__all__) <= MAX_NAMES
    assert len(set(toast.__all__)) == len(toast.__all__)


def test_every_name_in_all_resolves_to_its_modules_object():
    for name in toast.__all__:
        value = getattr(toast, name)
        assert not inspect.ismodule(value), name
        module = toast._NAMES.get(name)
        if module is not None:  # lazy: the object its module defines, not a copy
            assert value is getattr(importlib.import_module(module), name), name


def test_dir_lists_no_public_name_outside_all():
    assert _public_non_modules(dir(toast)) == _public_non_modules(toast.__all__)
    assert SUBPACKAGES <= set(dir(toast))


def test_the_subpackages_are_reachable_without_importing_them():
    code = (
        "import inspect, json, toast\n"
        f"names = {sorted(SUBPACKAGES)}\n"
        "print(json.dumps({n: inspect.ismodule(getattr(toast, n)) for n in names}))"
    )
    out = _run(code)
    assert json.loads(out.stdout) == dict.fromkeys(SUBPACKAGES, True)


def test_a_fresh_import_binds_no_public_name_outside_all():
    # After every name dir() offers has been resolved (and cached by the lazy
    # __getattr__), the module's namespace itself holds nothing else public:
    # no helper imported into it leaks out.
    code = (
        "import inspect, json, toast\n"
        "for name in dir(toast):\n"
        "    getattr(toast, name)\n"
        "print(json.dumps(sorted(n for n, v in vars(toast).items()\n"
        "                        if not n.startswith('_') and not inspect.ismodule(v))))"
    )
    out = _run(code)
    assert set(json.loads(out.stdout)) == _public_non_modules(toast.__all__)


def test_every_lazy_name_is_public_or_a_subpackage():
    from toast import _NAMES

    for name, module in _NAMES.items():
        assert name in toast.__all__ or module == f"toast.{name}", name


def test_every_config_loads_without_torch():
    # a config is what a user writes before anything runs (and what the CLI
    # reads for its help): reaching one costs no torch import
    configs = sorted(n for n in toast.__all__ if n.endswith("Config"))
    code = (
        "import json, sys, toast\n"
        f"for name in {configs}:\n"
        "    getattr(toast, name)\n"
        "print(json.dumps('torch' in sys.modules))"
    )
    assert len(configs) >= 5
    assert json.loads(_run(code).stdout) is False
