"""The Token Channel Selection MLP and the state it runs with: :class:`TcsMLP`,
which stands in for a block's MLP and samples tokens, scores and selects
channels and runs the dense or masked form; :class:`TcsOptions`, how it
scores and executes; :class:`TcsHandle`, what :func:`toast.methods.heads.tcs.enable_tcs`
installed in a model (and the workspace, samples and timings the blocks share).

The algorithm and every option are described in :mod:`toast.methods.heads.tcs`,
which installs these modules and re-exports the names here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from toast import _core
from toast.hf.model.vit import Attention, VitBlock, merged_row
from toast.methods.heads.schedules import Schedule, tcs_keep

__all__ = ["HANDLE_ATTR", "TcsHandle", "TcsMLP", "TcsOptions", "mlp_parts"]

# The model attribute that holds the installed handle (one TCS per model).
HANDLE_ATTR = "_toast_tcs"

#: A clock for profiling, or None when not profiling.
Clock = Callable[[], float] | None
#: Kept-channel indices, ``(B or 1, k)``; None where nothing is dropped.
Indices = torch.Tensor | None


@dataclass(frozen=True)
class TcsOptions:
    """How TCS scores and executes (see :mod:`toast.methods.heads.tcs`)."""

    score: str = "eq6"
    weights: str = "paper"
    lambda_cls: float = 2.0
    lambda_patch: float = 1.0
    scope: str = "image"
    form: str = "dense"
    sample_ratio: float = 0.02
    replace: bool = False
    resample: str = "fixed"
    fc2_sample: str = "same"
    hidden: str = "kept"
    seed: int = 0
    backend: str = "auto"


@dataclass
class TcsHandle:
    """What :func:`~toast.methods.heads.tcs.enable_tcs` installed; :meth:`disable`
    restores the model.

    ``profile=True`` makes every TCS block accumulate wall time (seconds) in
    ``timings``: ``"selection"`` (sampling, the CLS attention row, scores
    and top-k), ``"mlp"`` (the whole TCS MLP) and ``"block"`` (the whole
    transformer block). ``record=True`` keeps the last kept-channel indices
    of every block in ``selections[block] = (fc1, fc2)`` (``(B or 1, k)``
    tensors, ``None`` where a ratio is 0).

    The dense form gathers per-image weight rows into ``workspace`` buffers
    shared by the blocks and kept between calls (their size follows the
    largest batch seen; :meth:`release_workspace` frees them). A model with
    TCS enabled must not run forward passes from several threads at once.
    """

    model: nn.Module
    schedule: Schedule
    options: TcsOptions
    prefix: int
    modules: dict[int, TcsMLP] = field(default_factory=dict)
    originals: dict[int, tuple[nn.Module, nn.Module]] = field(default_factory=dict)
    hooks: list[RemovableHandle] = field(default_factory=list)
    profile: bool = False
    record: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    selections: dict[int, tuple[Indices, Indices]] = field(default_factory=dict)
    generator: torch.Generator | None = None
    workspace: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def reseed(self, seed: int | None = None) -> None:
        """Restarts the per-call sampler (``resample="call"``) and drops
        cached fixed samples; ``seed`` defaults to the options' seed."""
        seed = self.options.seed if seed is None else seed
        self.generator = torch.Generator().manual_seed(int(seed))
        for m in self.modules.values():
            m._samples.clear()

    def release_workspace(self) -> None:
        """Frees the gather buffers (the next forward pass allocates them again)."""
        self.workspace.clear()

    def reset_timings(self) -> None:
        self.timings = {"selection": 0.0, "mlp": 0.0, "block": 0.0}

    def disable(self) -> None:
        """Puts the original MLPs back and removes the hooks."""
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        for block, mlp in self.originals.values():
            block.mlp = mlp
        self.originals.clear()
        self.modules.clear()
        if getattr(self.model, HANDLE_ATTR, None) is self:
            delattr(self.model, HANDLE_ATTR)


@dataclass(frozen=True)
class _Scoring:
    """What one forward pass scores channels on: the sampled token
    positions, the CLS attention row (Eq. 6; None for Eq. 7), the block's
    token count and the profiling clock (None when not profiling)."""

    sample: torch.Tensor
    attn: torch.Tensor | None
    n: int
    clock: Clock

    def now(self) -> float:
        return self.clock() if self.clock else 0.0


def _seed_for(seed: int, block: int, which: int) -> int:
    return (int(seed) * 1_000_003 + block * 7_919 + which * 104_729) % (2**63 - 1)


class TcsMLP(nn.Module):
    """An MLP ``fc2(act(fc1(z)))`` with token channel selection. Holds the
    original ``fc1`` and ``fc2`` modules (state-dict keys unchanged)."""

    fc1: nn.Linear
    fc2: nn.Linear
    activation_fn: nn.Module
    # Not submodules: the handle and the attention belong to the model already.
    _handle: TcsHandle
    _attention: Attention

    def __init__(
        self,
        blk: VitBlock,
        r1: float,
        r2: float,
        handle: TcsHandle,
        eq6: bool,
    ) -> None:
        super().__init__()
        self.fc1, self.activation_fn, self.fc2 = mlp_parts(blk)
        self.block_index = blk.index
        self.r1, self.r2 = float(r1), float(r2)
        self.k1 = tcs_keep(self.fc1.in_features, r1)
        self.k2 = tcs_keep(self.fc2.in_features, r2)
        self.eq6 = eq6
        object.__setattr__(self, "_handle", handle)
        object.__setattr__(self, "_attention", blk.attention)
        self._samples: dict[tuple[int, int], torch.Tensor] = {}
        self._q: torch.Tensor | None = None
        self._k: torch.Tensor | None = None
        self._cache: dict[str, tuple[tuple[Any, ...], torch.Tensor]] = {}

    def extra_repr(self) -> str:
        return f"block={self.block_index}, fc1_keep={self.k1}, fc2_keep={self.k2}"

    def _in_c(self, x: torch.Tensor) -> bool:
        """Whether the selection of ``x`` runs in the C core."""
        backend = self._handle.options.backend
        ok = x.device.type == "cpu" and x.dtype == torch.float32
        if backend == "c" and not ok:
            raise ValueError(
                f"backend='c' needs float32 CPU activations, got {x.dtype} on {x.device}"
            )
        return ok and backend != "torch"

    # -- capture of the CLS attention row ------------------------------------

    def capture_q(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        """Forward hook of the attention's ``q_proj``: keeps the CLS row."""
        self._q = out[:, 0].detach()

    def capture_k(self, module: nn.Module, args: Any, out: torch.Tensor) -> None:
        """Forward hook of the attention's ``k_proj``: keeps every key."""
        self._k = out.detach()

    def _cls_attention(self) -> torch.Tensor:
        """Head-averaged CLS row of the attention map, ``(B, N)``."""
        q, k = self._q, self._k
        self._q = self._k = None
        if q is None or k is None:
            raise RuntimeError(
                f"TCS block {self.block_index} scores with the CLS attention row but its "
                "attention did not run q_proj/k_proj in this forward pass"
            )
        a = self._attention
        heads, dim = int(a.num_attention_heads), int(a.head_dim)
        if self._in_c(k):
            row = _core.tcs_cls_attention(
                q.contiguous().numpy(), k.contiguous().numpy(), heads, float(a.scaling)
            )
            return merged_row(a, torch.from_numpy(row))
        b, n = k.shape[0], k.shape[1]
        qh = q.reshape(b, heads, 1, dim)
        kh = k.reshape(b, n, heads, dim).transpose(1, 2)  # (B, H, N, d)
        logits = (qh @ kh.transpose(-1, -2)).squeeze(2) * a.scaling  # (B, H, N)
        return merged_row(a, torch.softmax(logits.float(), dim=-1).mean(dim=1).to(k.dtype))

    # -- sampling ----------------------------------------------------------------

    def _sample(self, n_tokens: int, which: int, device: torch.device) -> torch.Tensor:
        h = self._handle
        o = h.options
        patches = n_tokens - h.prefix
        if patches < 1:
            raise ValueError(
                f"TCS needs patch tokens; got {n_tokens} tokens with prefix {h.prefix}"
            )
        m = tcs_keep(patches, 1.0 - o.sample_ratio) if o.sample_ratio < 1 else patches
        key = (n_tokens, which)
        if o.resample == "fixed" and key in self._samples:
            return self._samples[key]
        if o.resample == "fixed":
            gen = torch.Generator().manual_seed(_seed_for(o.seed, self.block_index, which))
        else:
            if h.generator is None:
                h.reseed()
            assert h.generator is not None
            gen = h.generator
        if o.replace:
            pos = torch.randint(0, patches, (m,), generator=gen)
        else:
            pos = torch.randperm(patches, generator=gen)[:m]
        pos = (pos.sort().values + h.prefix).to(device)
        if o.resample == "fixed":
            self._samples[key] = pos
        return pos

    def _fc2_sample(self, sample: torch.Tensor, n: int, device: torch.device) -> torch.Tensor:
        if self._handle.options.fc2_sample == "fresh":
            return self._sample(n, 1, device)
        return sample

    # -- scores and top-k ------------------------------------------------------

    def _weights(self, n: int) -> tuple[float, float]:
        """``(weight of |x_cls|, weight of the sampled tokens' mean)``; ``n``
        is the block's token count."""
        o = self._handle.options
        if not self.eq6:
            return 0.0, 1.0
        if o.weights == "paper":
            return o.lambda_cls, o.lambda_patch
        p = n - 1  # the reference code's P: every token but the CLS
        return o.lambda_cls / (1 + p), o.lambda_patch * p / (1 + p)

    def _select(
        self, x: torch.Tensor, sample: torch.Tensor, attn: torch.Tensor | None, n: int, k: int
    ) -> torch.Tensor:
        """The ``k`` best channels of ``x`` (``(B, T, C)``; token 0 is the CLS
        for Eq. 6) scored on the tokens ``sample`` with the CLS attention
        ``attn`` (``(B, T)`` or None): ``(B, k)``, or ``(1, k)`` per batch."""
        o = self._handle.options
        cw, pw = self._weights(n)
        batch = o.scope == "batch"
        if self._in_c(x):
            idx = _core.tcs_select(
                x.detach().contiguous().numpy(),
                sample.cpu().numpy(),
                None if attn is None else attn.contiguous().numpy(),
                k,
                cw,
                pw,
                batch,
            )
            return torch.from_numpy(idx)
        mag = x[:, sample].abs()
        if attn is not None:
            a = attn.mean(dim=0, keepdim=True) if batch else attn
            mag = a[:, sample].unsqueeze(-1) * mag
        scores = pw * mag.mean(dim=1)
        if cw > 0:
            scores = scores + cw * x[:, 0].abs()
        if batch:
            scores = scores.mean(dim=0, keepdim=True)
        return torch.topk(scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values

    # -- weights -----------------------------------------------------------------

    def _transposed(self, name: str, lin: nn.Linear) -> torch.Tensor:
        """``lin.weight.t()`` as a contiguous matrix (``(in, out)``), cached
        while the weight is unchanged; a live view when gradients flow."""
        w = lin.weight
        if torch.is_grad_enabled() and w.requires_grad:
            return w.t()
        key = (w.data_ptr(), w._version, w.device, w.dtype, tuple(w.shape))
        hit = self._cache.get(name)
        if hit is None or hit[0] != key:
            hit = (key, w.detach().t().contiguous())
            self._cache[name] = hit
        return hit[1]

    # -- forward -----------------------------------------------------------------

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self._handle
        o = h.options
        clock = time.perf_counter if h.profile else None
        t_start = clock() if clock else 0.0
        n = z.shape[1]
        with torch.no_grad():
            sample = self._sample(n, 0, z.device)
            attn = self._cls_attention() if self.eq6 else None
            idx1 = None
            if self.k1 < z.shape[-1]:
                idx1 = self._select(z, sample, attn, n, self.k1)
        select_time = clock() - t_start if clock else 0.0
        ctx = _Scoring(sample, attn, n, clock)
        if o.form == "masked":
            out, idx2, dt = self._masked(z, idx1, ctx)
        elif o.hidden == "kept" and self.k2 < self.fc2.in_features:
            out, idx2, dt = self._dense_kept(z, idx1, ctx)
        else:
            out, idx2, dt = self._dense(z, idx1, ctx)
        if h.record:
            h.selections[self.block_index] = (idx1, idx2)
        if clock:
            h.timings["selection"] = h.timings.get("selection", 0.0) + select_time + dt
            h.timings["mlp"] = h.timings.get("mlp", 0.0) + clock() - t_start
        return out

    def _fc2_indices(self, hid: torch.Tensor, ctx: _Scoring) -> tuple[torch.Tensor, float]:
        """Top FC2 channels of the hidden activation ``(B, N, F)`` and the
        time it took."""
        t0 = ctx.now()
        with torch.no_grad():
            sample = self._fc2_sample(ctx.sample, ctx.n, hid.device)
            idx2 = self._select(hid, sample, ctx.attn, ctx.n, self.k2)
        return idx2, ctx.now() - t0

    def _masked(
        self, z: torch.Tensor, idx1: Indices, ctx: _Scoring
    ) -> tuple[torch.Tensor, Indices, float]:
        if idx1 is not None:
            z = z * _mask(idx1, z.shape[-1], z)
        hid = self.activation_fn(self.fc1(z))
        idx2: Indices = None
        dt = 0.0
        if self.k2 < hid.shape[-1]:
            idx2, dt = self._fc2_indices(hid, ctx)
            hid = hid * _mask(idx2, hid.shape[-1], hid)
        return self.fc2(hid), idx2, dt

    def _dense(
        self, z: torch.Tensor, idx1: Indices, ctx: _Scoring
    ) -> tuple[torch.Tensor, Indices, float]:
        hid = self._linear_in(z, idx1, self.fc1, "fc1")
        hid = self.activation_fn(hid)
        idx2: Indices = None
        dt = 0.0
        if self.k2 < hid.shape[-1]:
            idx2, dt = self._fc2_indices(hid, ctx)
        return self._linear_in(hid, idx2, self.fc2, "fc2"), idx2, dt

    def _rows(self, name: str, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``w[idx]`` for a matrix ``w`` and per-image indices ``idx`` (``(B, k)``)
        as a ``(B, k, w.shape[1])`` tensor. Without autograd the rows go into a
        workspace kept between calls (a fresh multi-MB tensor per call costs
        page faults on the CPU)."""
        if torch.is_grad_enabled() and w.requires_grad:
            return nn.functional.embedding(idx, w)
        b, k = idx.shape
        need = b * k * w.shape[1]
        spaces = self._handle.workspace  # shared: blocks run one at a time
        buf = spaces.get(name)
        if buf is None or buf.numel() < need or buf.dtype != w.dtype or buf.device != w.device:
            buf = torch.empty(need, dtype=w.dtype, device=w.device)
            spaces[name] = buf
        out = buf[:need].view(b * k, w.shape[1])
        torch.index_select(w, 0, idx.reshape(-1), out=out)
        return out.view(b, k, w.shape[1])

    def _linear_in(self, x: torch.Tensor, idx: Indices, lin: nn.Linear, name: str) -> torch.Tensor:
        """``lin`` applied to the channels ``idx`` of ``x`` only (all when
        ``idx`` is None); per image when ``idx`` has a row per image."""
        if idx is None:
            return lin(x)
        wt = self._transposed(name, lin)  # (in, out)
        if self._handle.options.scope == "batch":
            cols = idx[0]
            return torch.nn.functional.linear(
                x.index_select(-1, cols), wt.index_select(0, cols).t(), lin.bias
            )
        b, n, k = x.shape[0], x.shape[1], idx.shape[1]
        xs = torch.gather(x, 2, idx.unsqueeze(1).expand(b, n, k))
        w = self._rows(name, wt, idx)  # (B, k, out)
        if lin.bias is None:
            return torch.bmm(xs, w)
        return torch.baddbmm(lin.bias, xs, w)

    def _dense_kept(
        self, z: torch.Tensor, idx1: Indices, ctx: _Scoring
    ) -> tuple[torch.Tensor, Indices, float]:
        """Dense form computing only the kept hidden channels for all tokens."""
        sample = self._fc2_sample(ctx.sample, ctx.n, z.device)
        attn = ctx.attn
        # fc1 on the tokens FC2 scores on (the CLS first for Eq. 6), with the
        # dropped FC1 channels zeroed (a few rows: no weight gather); this
        # counts as selection time.
        t0 = ctx.now()
        with torch.no_grad():
            if self.eq6:
                rows = torch.cat([sample.new_zeros(1), sample])
                where = torch.arange(1, len(rows), device=z.device)
            else:
                rows, where = sample, torch.arange(len(sample), device=z.device)
            zr = z[:, rows]
            if idx1 is not None:
                zr = zr * _mask(idx1, zr.shape[-1], zr)
            sub = self.activation_fn(self.fc1(zr))
            idx2 = self._select(sub, where, None if attn is None else attn[:, rows], ctx.n, self.k2)
        dt = ctx.now() - t0
        w1 = self.fc1.weight  # (F, D)
        w2t = self._transposed("fc2", self.fc2)  # (F, D)
        b1, b2 = self.fc1.bias, self.fc2.bias
        if not (torch.is_grad_enabled() and w1.requires_grad):
            w1 = w1.detach()
        if self._handle.options.scope == "batch":
            cols = idx2[0]
            w1k = w1.index_select(0, cols)  # (k2, D)
            x = z
            if idx1 is not None:
                x, w1k = z.index_select(-1, idx1[0]), w1k.index_select(1, idx1[0])
            hid = nn.functional.linear(x, w1k, None if b1 is None else b1[cols])
            hid = self.activation_fn(hid)
            out = torch.matmul(hid, w2t.index_select(0, cols))
            return (out if b2 is None else out + b2), idx2, dt
        bsz, ntok = z.shape[0], z.shape[1]
        w1k = self._rows("fc1_kept", w1, idx2)  # (B, k2, D)
        x = z
        if idx1 is not None:
            k1 = idx1.shape[1]
            x = torch.gather(z, 2, idx1.unsqueeze(1).expand(bsz, ntok, k1))
            w1k = torch.gather(w1k, 2, idx1.unsqueeze(1).expand(bsz, w1k.shape[1], k1))
        hid = torch.bmm(x, w1k.transpose(1, 2))  # (B, N, k2)
        if b1 is not None:
            hid = hid + nn.functional.embedding(idx2, b1.unsqueeze(1)).transpose(1, 2)
        hid = self.activation_fn(hid)
        w2 = self._rows("fc2", w2t, idx2)  # (B, k2, D)
        out = torch.bmm(hid, w2) if b2 is None else torch.baddbmm(b2, hid, w2)
        return out, idx2, dt


def _mask(idx: torch.Tensor, width: int, like: torch.Tensor) -> torch.Tensor:
    """A ``(B or 1, 1, width)`` 0/1 mask of the kept channels."""
    m = torch.zeros(idx.shape[0], width, dtype=like.dtype, device=like.device)
    m.scatter_(1, idx, 1.0)
    return m.unsqueeze(1)


def mlp_parts(blk: VitBlock) -> tuple[nn.Linear, nn.Module, nn.Linear]:
    """``(fc1, activation, fc2)`` of a block's MLP; ``ValueError`` for any
    other MLP shape (SwiGLU)."""
    mlp = blk.mlp
    fc1, act, fc2 = (getattr(mlp, n, None) for n in ("fc1", "activation_fn", "fc2"))
    if not (isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear) and callable(act)):
        raise ValueError(
            f"block {blk.index}'s MLP ({type(mlp).__name__}) is not fc1 → act → fc2 "
            "(SwiGLU MLPs are not supported by TCS)"
        )
    return fc1, act, fc2
