"""``toast.search``: one call that finds the best compression of a model
for a target, across every method, by measurement.

Modules, in the order data flows through them: :mod:`.target` (what the
user asks for), :mod:`.calibrate` (the calibration passes),
:mod:`.candidates` (every applicable recipe with its size and predicted
error), :mod:`.build` (a recipe applied to a copy of the model),
:mod:`.measure` and :mod:`.latency` (held-out quality, size, throughput),
:mod:`.pareto` (the front, the rank correlation), :mod:`.result` and
:mod:`.plot` (the report), :mod:`.cache` (what a second call reuses) and
:mod:`.search` (the orchestration).
"""

from toast.frontier.result import Measured, SearchResult
from toast.frontier.search import search
from toast.frontier.target import Target

__all__ = ["Measured", "SearchResult", "Target", "search"]
