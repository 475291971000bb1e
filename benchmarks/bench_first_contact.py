"""What the README's quick start costs a new user: both commands on a fresh clone.

Clones the committed HEAD of this checkout into a temporary folder (no
``.venv``, no build, a toast cache of its own) and times, as a newcomer meets
them:

1. ``bash scripts/demo.sh``: every install, the C build, the ViT trained, the demo;
2. ``bash scripts/demo.sh`` again with a new empty cache: the demo alone, the ViT
   trained again (what ``toast demo`` costs once installed);
3. ``bash scripts/test.sh -q``: the extra installs of the test extra and the
   whole suite (skipped with ``--no-tests``).

Each run is appended to ``results/first_contact.json``; the README quotes the
range over every recorded run (``scripts/check_docs.py``, passage ``costs``).
pip's own download cache is left as it is: a user who installed torch before
has it too, and nothing else downloads here.

    python benchmarks/bench_first_contact.py              # about 35 min here
    python benchmarks/bench_first_contact.py --no-tests   # about 6 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "first_contact.json"


def _timed(command: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[float, int]:
    """Wall seconds and exit status of ``command``, its output written to ``log``."""
    start = time.perf_counter()
    with log.open("w") as out:
        status = subprocess.call(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    return time.perf_counter() - start, status


def _tests_summary(log: Path) -> str:
    """pytest's last line (``N passed, M skipped in S s``)."""
    lines = [line for line in log.read_text().splitlines() if re.search(r"\d+ passed", line)]
    return lines[-1].strip("= ") if lines else "no pytest summary (see the log)"


def _commit() -> str:
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    if dirty:
        print("bench_first_contact: uncommitted changes are not measured (the clone is of HEAD)",
              file=sys.stderr)  # fmt: skip
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def measure(tests: bool, keep: Path | None) -> dict:
    load_before = os.getloadavg()
    record: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
        "commit": _commit(),
        "seconds": {},
        "status": {},
        "demos": [],
    }
    with tempfile.TemporaryDirectory(prefix="toast-first-contact-") as folder:
        base = keep or Path(folder)
        clone = base / "toast"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOAST_", "VIRTUAL_ENV"))}
        steps = [
            ("demo_sh", ["bash", "scripts/demo.sh", "--out", str(base / "demo1")], "cache1"),
            ("demo", ["bash", "scripts/demo.sh", "--out", str(base / "demo2")], "cache2"),
        ]
        if tests:
            steps.append(("test_sh", ["bash", "scripts/test.sh", "-q"], "cache3"))
        for name, command, cache in steps:
            out = Path(command[-1]) if "--out" in command else None
            print(f"bench_first_contact: {name}: {' '.join(command)}", file=sys.stderr, flush=True)
            step_env = {**env, "TOAST_CACHE": str(base / cache)}
            log = base / f"{name}.log"
            seconds, status = _timed(command, clone, step_env, log)
            record["seconds"][name] = round(seconds, 1)
            record["status"][name] = status
            if name == "test_sh":
                record["tests"] = _tests_summary(log)
            elif status == 0 and out is not None:  # the demo's figures: the README's speed-up
                demo = json.loads((out / "result.json").read_text())
                record["demos"].append({k: demo[k] for k in ("speedup", "seconds")})
            print(f"bench_first_contact: {name}: {seconds:.0f} s, exit {status}", file=sys.stderr)
            if status != 0:
                print(log.read_text()[-4000:], file=sys.stderr)
                break
    record["machine"] = {
        "cpus": os.cpu_count(),
        "cpu": _cpu_name(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
    }
    return record


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true", help="time the demo only")
    parser.add_argument("--keep", type=Path, help="clone and log into this folder, kept")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file to append to")
    args = parser.parse_args(argv)
    record = measure(tests=not args.no_tests, keep=args.keep)
    runs = json.loads(args.out.read_text()) if args.out.exists() else []
    runs.append(record)
    args.out.write_text(json.dumps(runs, indent=1) + "\n")
    print(json.dumps(record, indent=1))
    return 0 if all(s == 0 for s in record["status"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
