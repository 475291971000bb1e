"""Measured throughput of a model on the device it runs on.

A compression search compares candidates by what they cost to run, and a
parameter count or a FLOP estimate says little about that on a real device
(memory traffic, kernel launch overheads, a KV cache). So every candidate is
timed here instead, cheaply but honestly: warm-up calls first (allocator,
lazy initialisation, kernel selection), then several rounds whose median is
reported (robust to one slow round caused by the rest of the machine), with
the batch size, sequence length and generated tokens stated in the result so
that two numbers are only compared when they measured the same thing.

For a causal LM two rates are reported, because compression moves them
differently: prefill (one full forward without a KV cache, compute-bound)
and greedy decoding with the KV cache at batch 1 (memory-bound).
"""

from __future__ import annotations

import inspect
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch

from toast._validation import Interval, check

__all__ = ["Throughput", "measure_throughput"]

#: Longest prompt used for the decode timing: decoding speed, not prompt length, is measured.
MAX_PROMPT_TOKENS = 64


@dataclass(frozen=True)
class Throughput:
    """What a model sustains on one device, with the settings that produced it.

    ``forward_per_s`` is images/s for image models, samples/s for other
    tensors, and tokens/s of a full forward without KV cache (prefill) for
    text, counting only the tokens the attention mask keeps.
    ``decode_tokens_per_s`` is only set for causal LMs: tokens/s generating
    ``new_tokens`` greedily with the KV cache at batch 1.
    """

    kind: str
    device: str
    batch_size: int
    seq_len: int | None
    forward_per_s: float
    decode_tokens_per_s: float | None
    new_tokens: int | None
    rounds: int
    unit: str

    def describe(self) -> str:
        """One line that cannot be quoted without its batch, length and device."""
        shape = f"batch {self.batch_size}"
        if self.seq_len is not None:
            shape += f" \u00d7 {self.seq_len}"
        if self.kind == "causal-lm":
            first = f"{_rate(self.forward_per_s)} {self.unit} prefill ({shape}, no KV cache)"
        elif self.seq_len is not None:
            first = f"{_rate(self.forward_per_s)} {self.unit} forward ({shape})"
        else:
            first = f"{_rate(self.forward_per_s)} {self.unit} ({shape})"
        parts = [first]
        if self.decode_tokens_per_s is not None:
            parts.append(
                f"{_rate(self.decode_tokens_per_s)} tokens/s decode "
                f"(batch 1, {self.new_tokens} new tokens, KV cache)"
            )
        return "; ".join(parts) + f"; {self.device}, median of {self.rounds}"

    def to_dict(self) -> dict[str, Any]:
        """Plain values, for JSON reports of a search."""
        return asdict(self)


def _rate(value: float) -> str:
    # Thousands separators for large rates, three significant digits for small ones.
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 1:
        return f"{value:.1f}"
    return f"{value:.3g}"


@dataclass(frozen=True)
class _Prepared:
    """One batch ready to time: what forward receives and what one call is worth."""

    inputs: torch.Tensor | dict[str, Any]
    unit: str
    units: float
    batch_size: int
    seq_len: int | None
    prompt: torch.Tensor | None


def _is_causal_lm(model: torch.nn.Module) -> bool:
    name = type(model).__name__
    named = name.endswith("ForCausalLM") or name.endswith("LMHeadModel")
    return named and callable(getattr(model, "generate", None))


def _model_device(model: torch.nn.Module) -> torch.device:
    # The first parameter's device is where the model expects its inputs.
    for parameter in model.parameters():
        return parameter.device
    for buffer in model.buffers():
        return buffer.device
    return torch.device("cpu")


def _unwrap(example: Any) -> torch.Tensor | dict[str, Any]:
    """The model's inputs from a tensor, a mapping or an ``(inputs, labels)`` pair."""
    expected = (
        "a tensor, a dict of tensors (e.g. tokenizer output with return_tensors='pt', "
        "or pixel_values) or an (inputs, labels) pair"
    )
    inputs = example[0] if isinstance(example, (tuple, list)) and len(example) > 0 else example
    if isinstance(inputs, torch.Tensor):
        return inputs
    if isinstance(inputs, Mapping):
        batch = dict(inputs)
        if any(isinstance(v, torch.Tensor) for v in batch.values()):
            if "input_ids" in batch and not isinstance(batch["input_ids"], torch.Tensor):
                raise ValueError(
                    "example['input_ids'] must be a torch.Tensor "
                    "(tokenize with return_tensors='pt')"
                )
            return batch
    raise ValueError(f"example must be {expected}; got no tensor in a {type(example).__name__}")


def _rows(inputs: torch.Tensor | dict[str, Any]) -> int:
    if isinstance(inputs, torch.Tensor):
        return int(inputs.shape[0]) if inputs.dim() > 0 else 1
    for key in ("input_ids", "pixel_values"):
        if isinstance(inputs.get(key), torch.Tensor) and inputs[key].dim() > 0:
            return int(inputs[key].shape[0])
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return 1


def _resize(
    inputs: torch.Tensor | dict[str, Any], batch_size: int, device: torch.device
) -> torch.Tensor | dict[str, Any]:
    """Moves tensors to ``device`` and takes ``batch_size`` rows, repeating them cyclically.

    Only tensors whose first dimension is the batch's are resized, so scalars
    and per-model tensors pass through unchanged.
    """
    rows = _rows(inputs)
    index = torch.arange(batch_size) % rows

    def fit(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.dim() > 0 and value.shape[0] == rows and batch_size != rows:
            value = value[index.to(value.device)]
        return value.to(device)

    if isinstance(inputs, torch.Tensor):
        return fit(inputs)
    return {key: fit(value) for key, value in inputs.items()}


def _token_count(batch: Mapping[str, Any]) -> int:
    """Tokens a text batch really holds: the attention mask's kept positions when
    there is a mask of the ids' shape (padding costs time but is not throughput),
    else batch × sequence length."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == ids.shape:
        return int((mask != 0).sum().item())
    return int(ids.numel())


def _prompt(batch: Mapping[str, Any]) -> torch.Tensor:
    """The first row's real tokens (padding dropped, either side), at most 64, shape (1, p)."""
    row = batch["input_ids"][0]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.shape == batch["input_ids"].shape:
        kept = row[mask[0] != 0]
        row = kept if kept.numel() > 0 else row[:1]
    return row[:MAX_PROMPT_TOKENS].unsqueeze(0)


def _prepare(
    model: torch.nn.Module, example: Any, batch_size: int | None, device: torch.device
) -> _Prepared:
    inputs = _unwrap(example)
    if (
        isinstance(inputs, torch.Tensor)
        and _is_causal_lm(model)
        and inputs.dim() == 2
        and not inputs.is_floating_point()
    ):
        inputs = {"input_ids": inputs}  # a bare token-id matrix for an LM is its input_ids
    inputs = _resize(inputs, batch_size or _rows(inputs), device)
    rows = _rows(inputs)
    if isinstance(inputs, dict) and "input_ids" in inputs:
        ids = inputs["input_ids"]
        if ids.dim() != 2:
            raise ValueError(
                f"example['input_ids'] must be 2-D (batch, seq_len); got shape {tuple(ids.shape)}"
            )
        prompt = _prompt(inputs) if _is_causal_lm(model) else None
        return _Prepared(inputs, "tokens/s", _token_count(inputs), rows, int(ids.shape[1]), prompt)
    image = (isinstance(inputs, dict) and "pixel_values" in inputs) or (
        isinstance(inputs, torch.Tensor) and inputs.dim() == 4 and inputs.is_floating_point()
    )
    return _Prepared(inputs, "images/s" if image else "samples/s", rows, rows, None, None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _accepts_use_cache(model: torch.nn.Module) -> bool:
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _forward_once(
    model: torch.nn.Module, inputs: torch.Tensor | dict[str, Any], extra: dict[str, Any]
) -> float:
    """Seconds for one forward call, synchronised on CUDA so the kernels are counted."""
    device = _model_device(model)
    _sync(device)
    start = time.perf_counter()
    if isinstance(inputs, torch.Tensor):
        model(inputs, **extra)
    else:
        model(**inputs, **extra)
    _sync(device)
    return time.perf_counter() - start


def _pad_id(model: torch.nn.Module) -> int:
    # Without a pad id generate() warns and picks one itself; pick it here, visibly.
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return 0


def _decode_once(model: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[float, int]:
    """Seconds for greedy generation of exactly ``new_tokens`` with the KV cache, and
    how many tokens came out (``min_new_tokens`` keeps an early EOS from
    shortening the run, which would inflate the rate)."""
    device = prompt.device
    mask = torch.ones_like(prompt)
    _sync(device)
    start = time.perf_counter()
    out = model.generate(
        prompt,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=_pad_id(model),
    )
    _sync(device)
    seconds = time.perf_counter() - start
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    return seconds, int(sequences.shape[1] - prompt.shape[1])


def _timed_rounds(
    model: torch.nn.Module,
    prepared: _Prepared,
    *,
    rounds: int,
    warmup: int,
    new_tokens: int,
    max_seconds: float | None,
) -> tuple[list[float], list[float]]:
    """Forward and decode times, one of each per round, interleaved so that a slow
    spell of the machine hits both alike; the time budget counts the warm-up."""
    extra = {"use_cache": False} if _accepts_use_cache(model) else {}
    forward_times: list[float] = []
    decode_times: list[float] = []
    start = time.perf_counter()
    for index in range(warmup + rounds):
        seconds = _forward_once(model, prepared.inputs, extra)
        decoded = None
        if prepared.prompt is not None:
            decoded, generated = _decode_once(model, prepared.prompt, new_tokens)
            if generated != new_tokens:
                raise RuntimeError(
                    f"generate produced {generated} tokens instead of new_tokens={new_tokens}; "
                    "the decode rate would be wrong"
                )
        if index < warmup:
            continue
        forward_times.append(seconds)
        if decoded is not None:
            decode_times.append(decoded)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    return forward_times, decode_times


def measure_throughput(
    model: torch.nn.Module,
    example: Any,
    *,
    rounds: int = 5,
    warmup: int = 1,
    batch_size: int | None = None,
    new_tokens: int = 32,
    max_seconds: float | None = None,
) -> Throughput:
    """Times ``model`` on ``example`` (one batch as the model takes it) on the model's
    own device, so that compressed candidates are ranked by what they actually
    cost there rather than by an assumed speed-up.

    ``batch_size`` takes or cyclically repeats the batch's rows so that
    candidates are timed on the same shape. ``max_seconds`` caps a
    measurement (warm-up included) at the rounds already run once it is
    exceeded, at least one; the result reports the rounds actually run. The
    model runs in eval mode under ``torch.inference_mode()``, and every
    module's training flag is restored afterwards, even on error.
    """
    rounds = check("rounds", rounds, Interval(int, 1, None))
    warmup = check("warmup", warmup, Interval(int, 0, None))
    new_tokens = check("new_tokens", new_tokens, Interval(int, 1, None))
    batch_size = check("batch_size", batch_size, Interval(int, 1, None), None)
    max_seconds = check("max_seconds", max_seconds, Interval(float, 0, None, "neither"), None)
    device = _model_device(model)
    prepared = _prepare(model, example, batch_size, device)
    flags = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        with torch.inference_mode():
            forward_times, decode_times = _timed_rounds(
                model,
                prepared,
                rounds=rounds,
                warmup=warmup,
                new_tokens=new_tokens,
                max_seconds=max_seconds,
            )
    finally:
        for module, training in flags:
            module.training = training
    causal = prepared.prompt is not None
    return Throughput(
        kind="causal-lm" if causal else "forward",
        device=str(device),
        batch_size=prepared.batch_size,
        seq_len=prepared.seq_len,
        forward_per_s=prepared.units / statistics.median(forward_times),
        decode_tokens_per_s=new_tokens / statistics.median(decode_times) if causal else None,
        new_tokens=new_tokens if causal else None,
        rounds=len(forward_times),
        unit=prepared.unit,
    )
