"""``toast.search``: one call that finds the best compression of a model
for a target, across every method, by measurement.

The search knows no method: it runs every registered method through the
stage API of :mod:`toast.methods.base` (needs, calibrate, propose, extend,
apply, finish), so a new method joins the search by registering its
stages (an import-linter contract keeps the methods' own modules out).

Modules, in the order data flows through them: :mod:`.target` (what the
user asks for), :mod:`.calibrate` (the shared pass and each method's
calibration), :mod:`.candidates` (every method's plans with their sizes
and predicted errors), :mod:`.build` (a plan applied to a copy of the
model), :mod:`.measure` and :mod:`.latency` (held-out quality, size,
throughput),
:mod:`.pareto` (the front, the rank correlation), :mod:`.result` and
:mod:`.plot` (the report), :mod:`.cache` (what a second call reuses) and
:mod:`.search` (the orchestration).
"""

from toast.frontier.result import Measured, SearchResult
from toast.frontier.search import search
from toast.frontier.target import Target

__all__ = ["Measured", "SearchResult", "Target", "search"]
