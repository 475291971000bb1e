"""Build script for the ``toast._core`` C extension.

Project metadata lives in pyproject.toml; this file only describes the extension.

Environment variables:

  TOAST_BLAS=auto|scipy-openblas|system
      auto (default): use the ``scipy_openblas32`` wheel if importable, else fall
      back to ``pkg-config openblas``.  ``scipy-openblas`` requires the wheel,
      ``system`` requires pkg-config.
  TOAST_WERROR=1     add -Werror.
  TOAST_SANITIZE=1   build with AddressSanitizer + UndefinedBehaviorSanitizer
                     (-O1 -g, asserts enabled).  Load the result with libasan and
                     libubsan in LD_PRELOAD (see scripts/asan.sh, ``make asan``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from glob import glob

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

HERE = os.path.dirname(os.path.abspath(__file__))

INSTALL_HELP = """
toast: no usable OpenBLAS found. The C extension needs CBLAS + LAPACK from OpenBLAS.
Either
  * install the scipy-openblas32 wheel into the environment that builds toast:
        pip install 'scipy-openblas32>=0.3.27'
    (pip does this automatically for an isolated build; with
    --no-build-isolation install it yourself first), or
  * install a system OpenBLAS that pkg-config can find, e.g.
        apt-get install libopenblas-dev pkg-config      (Debian/Ubuntu)
        dnf install openblas-devel pkgconf              (Fedora)
    and build with TOAST_BLAS=system.
Details:
"""


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _log(msg: str) -> None:
    print(f"toast setup: {msg}", file=sys.stderr, flush=True)


def _blas_from_wheel() -> tuple[dict | None, str]:
    """OpenBLAS from the scipy-openblas32 wheel (symbols prefixed with ``scipy_``)."""
    try:
        import scipy_openblas32
    except (ImportError, OSError) as exc:  # not installed, or its library failed to load
        return None, f"scipy_openblas32 is not importable ({exc!r})"
    include_dir = scipy_openblas32.get_include_dir()
    lib_dir = scipy_openblas32.get_lib_dir()
    library = scipy_openblas32.get_library()  # "scipy_openblas"
    if not glob(os.path.join(lib_dir, f"lib{library}*")):
        return None, f"scipy_openblas32 has no lib{library} in {lib_dir}"
    # Runtime search path for libscipy_openblas.so.  The build-time location may be
    # a throw-away isolated build env, so also point at the places where the
    # runtime dependency scipy-openblas32 is installed next to toast:
    #   - $ORIGIN/../scipy_openblas32/lib   (toast/_core*.so inside site-packages)
    #   - <purelib of the target interpreter>/scipy_openblas32/lib (editable installs)
    rpaths = [lib_dir, "$ORIGIN/../scipy_openblas32/lib"]
    for key in ("purelib", "platlib"):
        rpaths.append(os.path.join(sysconfig.get_paths()[key], "scipy_openblas32", "lib"))
    rpaths = list(dict.fromkeys(os.path.normpath(p) if "$" not in p else p for p in rpaths))
    cfg = {
        "include_dirs": [include_dir],
        "library_dirs": [lib_dir],
        "libraries": [library],
        "define_macros": [("TOAST_BLAS_PREFIX", "scipy_")],
        "extra_compile_args": [],
        "extra_link_args": [f"-Wl,-rpath,{p}" for p in rpaths],
    }
    version = getattr(scipy_openblas32, "__version__", "?")
    return cfg, f"scipy-openblas32 {version} ({lib_dir}, -l{library}, symbol prefix scipy_)"


def _pkg_config(*args: str) -> list[str]:
    out = subprocess.run(
        ["pkg-config", *args, "openblas"], check=True, capture_output=True, text=True
    )
    return shlex.split(out.stdout)


def _blas_from_pkgconfig() -> tuple[dict | None, str]:
    """System OpenBLAS via pkg-config (unprefixed symbols)."""
    try:
        cflags = _pkg_config("--cflags")
        libs = _pkg_config("--libs")
        version = " ".join(_pkg_config("--modversion"))
    except FileNotFoundError:
        return None, "pkg-config is not installed"
    except subprocess.CalledProcessError as exc:
        return None, f"`pkg-config openblas` failed: {exc.stderr.strip()}"
    cfg: dict = {
        "include_dirs": [],
        "library_dirs": [],
        "libraries": [],
        "define_macros": [],
        "extra_compile_args": [],
        "extra_link_args": [],
    }
    for f in cflags:
        if f.startswith("-I"):
            cfg["include_dirs"].append(f[2:])
        else:
            cfg["extra_compile_args"].append(f)
    for f in libs:
        if f.startswith("-L"):
            cfg["library_dirs"].append(f[2:])
            cfg["extra_link_args"].append(f"-Wl,-rpath,{f[2:]}")
        elif f.startswith("-l"):
            cfg["libraries"].append(f[2:])
        else:
            cfg["extra_link_args"].append(f)
    if not cfg["libraries"]:
        cfg["libraries"].append("openblas")
    return cfg, f"system OpenBLAS {version} via pkg-config ({' '.join(libs)})"


def _blas_config() -> dict:
    choice = os.environ.get("TOAST_BLAS", "auto").strip().lower() or "auto"
    if choice == "auto":
        finders = [_blas_from_wheel, _blas_from_pkgconfig]
    elif choice in {"scipy-openblas", "scipy_openblas", "scipy-openblas32", "wheel"}:
        finders = [_blas_from_wheel]
    elif choice in {"system", "pkg-config", "pkgconfig"}:
        finders = [_blas_from_pkgconfig]
    else:
        raise SystemExit(
            f"toast setup: unknown TOAST_BLAS={choice!r} (use auto, scipy-openblas or system)"
        )
    reasons = []
    for finder in finders:
        cfg, desc = finder()
        if cfg is not None:
            _log(f"using BLAS: {desc}")
            return cfg
        reasons.append(f"  - {desc}")
    raise SystemExit(INSTALL_HELP + "\n".join(reasons))


def _extension() -> Extension:
    blas = _blas_config()
    compile_args = ["-std=c11", "-O3", "-fopenmp-simd", "-Wall", "-Wextra"]
    link_args: list[str] = []
    if _flag("TOAST_WERROR"):
        compile_args.append("-Werror")
    if _flag("TOAST_SANITIZE"):
        san = [
            "-fsanitize=address,undefined",
            "-fno-sanitize-recover=all",
            "-fno-omit-frame-pointer",
        ]
        # Later flags win over Python's default CFLAGS (-O3 -DNDEBUG -fwrapv ...):
        # -fno-wrapv so that UBSan reports signed-integer overflow, -UNDEBUG for asserts.
        compile_args += san + ["-O1", "-g", "-UNDEBUG", "-fno-wrapv"]
        link_args += san
        _log("sanitizers ON (address, undefined)")
    # Relative paths (setup.py chdirs to the repo root): required for sdists.
    sources = sorted(glob("csrc/*.c")) + ["toast/_coremodule.c"]
    headers = sorted(glob("csrc/*.h"))
    return Extension(
        "toast._core",
        sources=sources,
        depends=headers,
        include_dirs=["csrc", numpy.get_include(), *blas["include_dirs"]],
        library_dirs=blas["library_dirs"],
        libraries=blas["libraries"],
        define_macros=blas["define_macros"],
        extra_compile_args=compile_args + blas["extra_compile_args"],
        extra_link_args=link_args + blas["extra_link_args"],
    )


class build_ext(_build_ext):
    """Always a clean, private, atomic build (the extension is small):

    * every object is recompiled (``force``): a shared ``build/`` may hold objects from a
      sanitizer build or another environment (different rpath), and distutils' timestamp
      check would silently reuse them;
    * objects go to a private temporary directory (and, for ``--inplace``, so does the
      linked module), so concurrent builds in one checkout cannot mix their files;
    * the in-place module is replaced atomically (copy + rename), so a process that
      already loaded the old ``toast/_core*.so`` keeps running undisturbed.
    """

    def finalize_options(self):
        super().finalize_options()
        self.force = True

    def run(self):
        tmp = tempfile.mkdtemp(prefix="toast-build-")
        self.build_temp = os.path.join(tmp, "temp")
        if self.inplace and not self.editable_mode:
            self.build_lib = os.path.join(tmp, "lib")
        try:
            super().run()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def copy_file(self, infile, outfile, *args, **kwargs):
        if os.path.isdir(outfile):
            outfile = os.path.join(outfile, os.path.basename(infile))
        tmp = f"{outfile}.tmp-{os.getpid()}"
        try:
            _, copied = super().copy_file(infile, tmp, *args, **kwargs)
            os.replace(tmp, outfile)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return outfile, copied


os.chdir(HERE)
setup(ext_modules=[_extension()], cmdclass={"build_ext": build_ext})
