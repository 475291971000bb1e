"""Peak anonymous resident memory of a command, watched from outside.

A user meets a memory promise as the resident memory of the process they
started, not as a figure the process reports about itself. :func:`run_polled`
starts a command and polls ``RssAnon`` (anonymous resident memory: the heap,
tensors, buffers; not the file pages of mapped weights or libraries, which
the kernel may drop at any time) of the process and all its descendants in
``/proc`` every ``interval`` seconds, and returns the largest sum seen with
the command's exit status, wall time and a timeline.

Usage as a script::

    python benchmarks/_peak.py [--interval 0.2] [--log FILE] -- CMD ARGS...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Polled", "rss_anon_mib", "run_polled"]


@dataclass
class Polled:
    """What :func:`run_polled` saw: exit status, wall seconds, the peak
    ``RssAnon`` in MiB and ``(seconds, MiB)`` samples."""

    returncode: int
    wall_s: float
    peak_mib: float
    timeline: list[tuple[float, float]] = field(default_factory=list)


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def rss_anon_mib(pid: int) -> float:
    """``RssAnon`` of ``pid`` and its descendants, in MiB (0 once gone)."""
    total = 0.0
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            for line in Path(f"/proc/{current}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) / 1024
                    break
        except OSError:
            continue
        todo.extend(_children(current))
    return total


def run_polled(
    cmd: list[str],
    *,
    interval: float = 0.2,
    log: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> Polled:
    """Runs ``cmd`` (its output to ``log``, else discarded) and polls its
    anonymous resident memory every ``interval`` seconds until it exits
    (killed after ``timeout`` seconds, returncode then -9)."""
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed below
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    peak, timeline = 0.0, []
    try:
        while proc.poll() is None:
            now = time.perf_counter() - start
            mib = rss_anon_mib(proc.pid)
            peak = max(peak, mib)
            timeline.append((now, mib))
            if timeout is not None and now > timeout:
                proc.kill()
            time.sleep(interval)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if log:
            out.close()  # type: ignore[union-attr]
    return Polled(proc.returncode, time.perf_counter() - start, peak, timeline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--log", default=None, help="the command's output (default: discarded)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command after --")
    polled = run_polled(cmd, interval=args.interval, log=args.log)
    print(
        f"exit {polled.returncode}, {polled.wall_s:.1f} s, peak RssAnon {polled.peak_mib:.0f} MiB",
        file=sys.stderr,
    )
    sys.exit(polled.returncode)


if __name__ == "__main__":
    main()
