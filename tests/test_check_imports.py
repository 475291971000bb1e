"""scripts/check_imports.py: the import rules that scripts/lint.sh runs, on
small package trees planted in a temporary folder (and on the package)."""

import textwrap
from pathlib import Path

import pytest

from tests._helpers import load_script

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_imports.py"
check_imports = load_script(SCRIPT)


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``toast`` under ``tmp_path`` holding ``files`` (path → source);
    every folder gets an ``__init__.py``."""
    root = tmp_path / "toast"
    for name, source in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in [path.parent, *path.parent.parents]:
            if folder == root.parent:
                break
            (folder / "__init__.py").touch()
        path.write_text(textwrap.dedent(source))
    return root


DEFINES = {
    "io/save.py": """
        def _fsync_path(p): ...
        def fsync_path(p): ...
        class Fitter:
            def _closed_form(self): ...
            def fit(self):
                return self._closed_form()
    """,
}


def flagged(root: Path) -> list[tuple[str, int, str]]:
    return [
        (str(v.path.relative_to(root)), v.line, v.message)
        for v in check_imports.private_violations(root)
    ]


def test_clean_tree_passes(tmp_path):
    root = plant(
        tmp_path,
        {
            **DEFINES,
            "hf/user.py": """
            from __future__ import annotations
            from toast import _core, _lazy
            import toast._lazy
            from toast.io.save import fsync_path, Fitter
            from toast.io import __doc__
            import torch
            from torch.nn import _reduction

            def run(fitter: Fitter, module):
                module._buffers.clear()  # a third-party private: not this rule's
                return fitter.fit()
        """,
            "_lazy.py": "",
        },
    )
    assert flagged(root) == []
    assert check_imports.main(["check_imports.py", str(root)]) == 0


def test_private_import_is_flagged_with_the_fix(tmp_path):
    root = plant(tmp_path, {**DEFINES, "hf/user.py": "from toast.io.save import _fsync_path\n"})
    [(path, line, message)] = flagged(root)
    assert (path, line) == ("hf/user.py", 1)
    assert "'_fsync_path'" in message
    assert "make it public in toast.io.save or move the code" in message
    assert check_imports.main(["check_imports.py", str(root)]) == 1


def test_relative_private_import_is_flagged(tmp_path):
    root = plant(tmp_path, {**DEFINES, "io/user.py": "from .save import _fsync_path\n"})
    assert [(p, m.split(":")[0]) for p, _, m in flagged(root)] == [
        ("io/user.py", "imports private name '_fsync_path' from toast.io.save")
    ]


def test_private_import_inside_a_function_is_flagged(tmp_path):
    root = plant(
        tmp_path,
        {
            **DEFINES,
            "hf/user.py": """
            def write(path):
                from toast.io.save import _fsync_path

                _fsync_path(path)
        """,
        },
    )
    assert [(p, line) for p, line, _ in flagged(root)] == [("hf/user.py", 3)]


def test_private_attribute_of_another_modules_class_is_flagged(tmp_path):
    root = plant(
        tmp_path,
        {
            **DEFINES,
            "methods/from_disk.py": """
            from toast.io.save import Fitter

            def fit(fitter: Fitter):
                return fitter._closed_form()
        """,
        },
    )
    [(path, line, message)] = flagged(root)
    assert (path, line) == ("methods/from_disk.py", 5)
    assert "fitter._closed_form" in message and "toast.io.save" in message


def test_private_attribute_the_module_defines_is_allowed(tmp_path):
    root = plant(
        tmp_path,
        {
            **DEFINES,
            "methods/own.py": """
            class Other:
                def _closed_form(self): ...
                def __eq__(self, other):
                    return other._closed_form() == self._closed_form()
        """,
        },
    )
    assert flagged(root) == []


def test_the_package_has_no_private_imports():
    root = SCRIPT.parents[1] / "toast"
    assert [str(v) for v in check_imports.private_violations(root)] == []


BOUNDARY = {
    "methods/base.py": "class Method: ...\n",
    "methods/translate/config.py": "class ToastConfig: ...\n",
}


@pytest.mark.parametrize("package", ["frontier", "cli"])
def test_boundary_flags_a_methods_inner_module(tmp_path, package):
    root = plant(
        tmp_path,
        {
            **BOUNDARY,
            f"{package}/build.py": """
            from toast.methods import compress
            from toast.methods.base import Method

            def configure():
                from toast.methods.translate.config import ToastConfig
                import toast.methods.translate.config
                from toast.methods import translate
        """,
        },
    )
    found = check_imports.boundary_violations(root)
    assert sorted((v.line, v.message.split(":")[0]) for v in found) == [
        (6, "imports toast.methods.translate.config"),
        (7, "imports toast.methods.translate.config"),
        (8, "imports toast.methods.translate"),
    ]
    assert check_imports.main(["check_imports.py", "--strict", str(root)]) == 1


def test_boundary_passes_the_stage_api_and_other_packages(tmp_path):
    root = plant(
        tmp_path,
        {
            **BOUNDARY,
            "frontier/build.py": """
            import toast.methods
            from toast.methods import compress
            from toast.methods.base import Method
        """,
            # the rule binds frontier/ and cli/ only
            "hf/user.py": "from toast.methods.translate.config import ToastConfig\n",
        },
    )
    assert check_imports.boundary_violations(root) == []
    assert check_imports.main(["check_imports.py", "--strict", str(root)]) == 0


def test_a_method_importing_another_method_is_flagged(tmp_path):
    root = plant(
        tmp_path,
        {
            "methods/base.py": "X = 1\n",
            "methods/alpha/stages.py": "def f(): ...\n",
            "methods/beta/method.py": """
                from toast.methods.base import X
                from toast.methods.beta import helper
                def g():
                    from toast.methods.alpha.stages import f
            """,
            "methods/beta/helper.py": "",
        },
    )
    found = check_imports.independence_violations(root)
    assert [(v.path.name, v.line) for v in found] == [("method.py", 5)]
    assert "the method 'beta' may not use the method 'alpha'" in found[0].message


def test_a_new_method_package_is_covered_without_a_list(tmp_path):
    root = plant(
        tmp_path,
        {"methods/alpha/a.py": "", "methods/gamma/g.py": "import toast.methods.alpha.a\n"},
    )
    assert [v.path.name for v in check_imports.independence_violations(root)] == ["g.py"]
