"""LoRAFusion's fused multi-LoRA linear beside ours, on the problem `benchmarks/kernels.py` builds.

LoRAFusion (public CentML/lorafusion, no LICENSE file in the repository) is never vendored here: it is imported
at run time from a source tree given on the command line (a checkout or ``git archive`` export, e.g.
``.lorafusion/``, which ``.git/info/exclude`` keeps out of git). Check it against our reference and time it on
the H200 (bf16):

    PYTHONPATH=. python benchmarks/lorafusion_side.py --src .lorafusion

On a machine without a GPU the same check runs in the Triton interpreter (fp32; slow, correctness only):

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/lorafusion_side.py --src .lorafusion --dtype float32 \
        --d-in 256 --d-out 256 --ranks 16 8 32 --tokens 128 64 200

The op is ``lorafusion.ops.multi_lora.fused_linear_multi_lora`` (the autograd Function ``FusedLinearMultiLoRA``):
``Y = X W^T + [s_i * (X_i A_i^T) B_i^T]_i`` over a packed ``(1, T_pad, d_in)`` buffer whose adapter segments are
each padded to its 128-row block, and the matching backward (``dX = dY W + dS_i A_i``, ``dA_i``, ``dB_i``; ``W``
frozen). So it times the frozen linear together with the LoRA path: compare it with ours through
`multi_lora_linear_triton` (same fusion), not with `multi_lora_triton` over a precomputed base output.

Its limits, checked by `make_lorafusion_step` (``ValueError``):
- 1 to 4 adapters per call (``FusedLinearMultiLoRA`` has four A and four B slots);
- every row belongs to one adapter: segments contiguous, non-empty, covering ``[0, T)``; each is padded up to a
  multiple of ``block_size_m`` (128 in its H100 config) and the padded total is at most
  ``MAX_NUM_BLOCK_M_SIZE`` (192) blocks, i.e. 24,576 rows (its pointer tables have 192 slots);
- ``d_in`` and ``d_out`` multiples of ``BLOCK_SIZE_N`` (256): the kernels read W, A and B tiles without an N mask;
- X, W, A, B in one dtype (the kernels cast the pointers they load to the output dtype); our fp32 adapters are
  given as bf16 copies, as our own kernels read bf16 copies; the per-block scaling is stored in that dtype too;
- no dropout: with ``p > 0`` its forward applies the mask to the frozen product's input, not to the LoRA path's,
  so it is not the same function as ours / PEFT's;
- ``MAX_R`` (a ``tl.arange`` bound) must be a power of two >= 16: we pass the largest rank rounded up (the
  kernels mask by each block's own rank, so the result is unchanged; its own ``prepare_multi_lora_batch_info``
  passes the raw largest rank: ``arange's range must be a power of 2`` for 24, and ``tl.dot`` wants K >= 16).

Stand-ins: ``megatron`` (always; the op never calls ``parallel_state``, only its training manager does), and,
where not installed, ``loguru``, ``tabulate``, ``mypy_extensions`` and ``tqdm`` (imported by its test and
benchmark helpers). Its kernel configs are keyed by GPU name and exist for the H100 only: on another sm_90 GPU
(the H200) the H100 entry is registered under that GPU's name.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_multilora.kernels.weights import LoRAWeights

MAX_ADAPTERS = 4
H100_KEY = "h100-80gb-hbm3"


# ---------------------------------------------------------------------------------------------------------------
# Loading


class _Logger:
    """What ``from loguru import logger`` gives the op's modules: messages go to stderr, nothing else."""

    def _say(self, level: str, msg: Any, *args: Any, **kwargs: Any) -> None:
        if level in ("WARNING", "ERROR"):
            print(f"[lorafusion {level.lower()}] {msg}", file=sys.stderr)

    def __getattr__(self, name: str):
        return lambda msg="", *a, **k: self._say(name.upper(), msg)


def _not_available(name: str):
    def fail(*args: Any, **kwargs: Any):
        raise RuntimeError(f"{name} is a stand-in made by benchmarks/lorafusion_side.py; the op does not need it")
    return fail


def _stub_modules() -> dict[str, types.ModuleType]:
    stubs: dict[str, types.ModuleType] = {}

    def module(name: str, **attrs: Any) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        mod.__lorafusion_stub__ = True
        stubs[name] = mod
        return mod

    if "megatron" not in sys.modules:  # the op's module imports parallel_state for its training manager only
        parallel_state = module("megatron.core.parallel_state")
        parallel_state.__getattr__ = lambda name: _not_available(f"megatron.core.parallel_state.{name}")
        core = module("megatron.core", parallel_state=parallel_state)
        module("megatron", core=core)
    if importlib.util.find_spec("loguru") is None:
        module("loguru", logger=_Logger())
    if importlib.util.find_spec("tabulate") is None:
        module("tabulate", tabulate=_not_available("tabulate.tabulate"))
    if importlib.util.find_spec("mypy_extensions") is None:
        module("mypy_extensions", DefaultNamedArg=lambda *a, **k: Any, NamedArg=lambda *a, **k: Any)
    if importlib.util.find_spec("tqdm") is None:
        module("tqdm", tqdm=lambda it=None, *a, **k: it)
    return stubs


class _HostTorch:
    """``torch`` as seen by LoRAFusion's pointer-table builders in the interpreter: their hard-coded
    ``device="cuda"`` allocations go to the CPU. Used only when ``TRITON_INTERPRET=1`` without a GPU."""

    def __init__(self, real) -> None:
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def _cpu(self, fn, *args, device=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return fn(*args, device=device, **kwargs)

    def empty(self, *args, **kwargs):
        return self._cpu(self._real.empty, *args, **kwargs)

    def zeros(self, *args, **kwargs):
        return self._cpu(self._real.zeros, *args, **kwargs)


@dataclass
class LoRAFusion:
    """The loaded op and the limits read from its source."""

    src: str
    multi_lora: types.ModuleType
    fused_linear_multi_lora: Any
    block_size_m: int
    max_blocks: int
    block_size_n: int
    hardware: str  # the kernel-config entry used
    stubs: list[str] = field(default_factory=list)
    interpret: bool = False
    notes: list[str] = field(default_factory=list)


_loaded: dict[str, LoRAFusion] = {}
_last: Optional[LoRAFusion] = None


def load_lorafusion(src: str) -> LoRAFusion:
    """Import ``lorafusion.ops.multi_lora`` from the source tree ``src`` (the folder holding ``lorafusion/``).

    Installs stand-ins for the imports the op does not use (see the module docstring) only for the import and
    takes them out of ``sys.modules`` again; picks the kernel configuration (H100's on any sm_90 GPU it lacks);
    without a GPU, needs ``TRITON_INTERPRET=1`` and redirects its ``cuda`` pointer tables to the CPU.
    """
    global _last
    root = Path(src).resolve()
    if str(root) in _loaded:
        _last = _loaded[str(root)]
        return _last
    if not (root / "lorafusion" / "ops" / "multi_lora.py").is_file():
        raise FileNotFoundError(f"{root} has no lorafusion/ops/multi_lora.py: "
                                "give the root of a CentML/lorafusion tree")
    have = sys.modules.get("lorafusion")
    if have is not None and not str(Path(have.__file__).resolve()).startswith(str(root)):
        raise RuntimeError(f"another lorafusion is already imported from {have.__file__}")
    interpret = not torch.cuda.is_available()
    if interpret and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("no CUDA device: set TRITON_INTERPRET=1 (before triton is imported) to run LoRAFusion's "
                           "kernels in the Triton interpreter")
    stubs = _stub_modules()
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        multi_lora = importlib.import_module("lorafusion.ops.multi_lora")
        config = importlib.import_module("lorafusion.ops.triton_ops.config")
        xw_sb = importlib.import_module("lorafusion.ops.triton_ops.fused_multi_lora_xw_sb")
        dys_dyb = importlib.import_module("lorafusion.ops.triton_ops.fused_multi_lora_dys_dyb")
        dyw_dsa = importlib.import_module("lorafusion.ops.triton_ops.fused_multi_lora_dyw_dsa")
    finally:
        for name, mod in saved.items():  # the op's modules keep the names they bound; nothing else sees the stubs
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod

    notes = []
    if interpret:
        hardware = H100_KEY
        config.get_device_short_name = lambda: H100_KEY
        for mod in (xw_sb, dys_dyb, dyw_dsa):
            mod.torch = _HostTorch(torch)
        notes.append("Triton interpreter: H100 configs, pointer tables on the CPU")
    else:
        hardware = config.get_device_short_name()
        if hardware not in config.HARDWARE_CONFIGS:
            if torch.cuda.get_device_capability() != (9, 0):
                raise RuntimeError(f"LoRAFusion has kernel configs for {sorted(config.HARDWARE_CONFIGS)} only, "
                                   f"not {hardware}; tune them with its tools/tune_kernels.py")
            config.HARDWARE_CONFIGS[hardware] = config.H100_CONFIG
            notes.append(f"{hardware}: LoRAFusion's H100 kernel configs (same sm_90 chip)")
            hardware = f"{hardware} (as {H100_KEY})"
    block_m = config.get_lora_kernel_config("fused_multi_lora_block_size_m")
    kcfgs = [config.get_lora_kernel_config(k) for k in
             ("fused_multi_lora_xw_sb", "fused_multi_lora_dyw_dsa", "fused_multi_lora_dys_dyb")]
    if any(c.block_size_m != block_m for c in kcfgs):
        raise RuntimeError(f"LoRAFusion's multi-LoRA kernel configs disagree on BLOCK_SIZE_M: {kcfgs}")
    block_n = math.lcm(*(c.block_size_n for c in kcfgs if c.block_size_n))
    max_blocks = min(xw_sb.MAX_NUM_BLOCK_M_SIZE, dys_dyb.MAX_NUM_BLOCK_M_SIZE, dyw_dsa.MAX_NUM_BLOCK_M_SIZE)
    lf = LoRAFusion(str(root), multi_lora, multi_lora.fused_linear_multi_lora, block_m, max_blocks, block_n,
                    hardware, sorted(stubs), interpret, notes)
    _loaded[str(root)] = lf
    _last = lf
    return lf


# ---------------------------------------------------------------------------------------------------------------
# One step


def _pow2_at_least(n: int, low: int = 16) -> int:
    return max(low, 1 << (n - 1).bit_length())


class LoRAFusionStep:
    """One forward + backward of LoRAFusion's op on a fixed problem; call it with no arguments.

    Inputs that LoRAFusion needs in another layout (padded rows, adapter weights in the activation dtype) are
    made once here, outside the call, as its data pipeline would hand them over. Gradients accumulate in the
    ``.grad`` of `a` and `b`; `x_leaf`'s is made anew by every call (as in benchmarks/kernels.py: dX is written,
    never added into an older one).
    """

    def __init__(self, lf: LoRAFusion, x: Tensor, base_weight: Tensor, weights: LoRAWeights, grad: Tensor) -> None:
        n = len(weights.a)
        t, d_in = x.shape if x.dim() == 2 else (None, None)
        if t is None:
            raise ValueError(f"LoRAFusion: x must be (T, d_in), got {tuple(x.shape)}")
        if n == 0 or n > MAX_ADAPTERS:
            raise ValueError(f"LoRAFusion's FusedLinearMultiLoRA takes 1 to {MAX_ADAPTERS} adapters per call, got {n}")
        d_out = base_weight.shape[0]
        if base_weight.shape != (d_out, d_in) or base_weight.dtype != x.dtype or base_weight.requires_grad:
            raise ValueError(f"LoRAFusion: base_weight must be a frozen (d_out, d_in={d_in}) tensor in {x.dtype}, "
                             f"got {tuple(base_weight.shape)} {base_weight.dtype} "
                             f"requires_grad={base_weight.requires_grad}")
        if grad.shape != (t, d_out):
            raise ValueError(f"LoRAFusion: grad must be (T={t}, d_out={d_out}), got {tuple(grad.shape)}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"LoRAFusion: activations in bf16, fp16 or fp32, got {x.dtype}")
        if any(p > 0 for p in weights.dropout):
            raise ValueError("LoRAFusion with dropout > 0 applies the mask to the frozen product's input, not the "
                             "LoRA path's: not the function we compute; run it with dropout 0")
        if d_in % lf.block_size_n or d_out % lf.block_size_n:
            raise ValueError(f"LoRAFusion's kernels read W/A/B tiles of {lf.block_size_n} columns unmasked: d_in and "
                             f"d_out must be multiples of {lf.block_size_n}, got {d_in}x{d_out}")
        prev = 0
        for s, e in zip(weights.starts, weights.ends):
            if s != prev or e <= s:
                raise ValueError("LoRAFusion gives every row to one adapter: segments must be non-empty, in order and "
                                 f"contiguous from row 0, got starts {weights.starts} ends {weights.ends}")
            prev = e
        if prev != t:
            raise ValueError(f"LoRAFusion: the segments cover rows [0, {prev}) of {t}; every row needs an adapter")
        ranks = [a.shape[0] for a in weights.a]
        for a, b, r in zip(weights.a, weights.b, ranks):
            if a.shape != (r, d_in) or b.shape != (d_out, r):
                raise ValueError(f"LoRAFusion: A must be (r, {d_in}) and B ({d_out}, r), got {tuple(a.shape)}, "
                                 f"{tuple(b.shape)}")
        bm = lf.block_size_m
        seq = [e - s for s, e in zip(weights.starts, weights.ends)]
        padded = [-(-n_rows // bm) * bm for n_rows in seq]
        blocks = sum(padded) // bm
        if blocks > lf.max_blocks:
            raise ValueError(f"LoRAFusion's pointer tables hold {lf.max_blocks} blocks of {bm} rows "
                             f"({lf.max_blocks * bm} padded rows); this problem needs {blocks}")

        device, dtype = x.device, x.dtype
        self.lf, self.n, self.t, self.t_pad = lf, n, t, sum(padded)
        self.seq, self.padded = seq, padded
        # Padded rows: segment i starts at row sum(padded[:i]); the others stay zero.
        self.aligned = padded == seq
        if self.aligned:
            self.rows = None
            xp = x.detach().reshape(1, t, d_in)
            gp = grad.detach().reshape(1, t, d_out)
        else:
            self.rows = torch.cat([torch.arange(p0, p0 + n_rows, device=device)
                                   for p0, n_rows in zip(_starts(padded), seq)])
            xp = torch.zeros(1, self.t_pad, d_in, device=device, dtype=dtype)
            xp[0, self.rows] = x.detach()
            gp = torch.zeros(1, self.t_pad, d_out, device=device, dtype=grad.dtype)
            gp[0, self.rows] = grad.detach()
        self.x_leaf = xp.requires_grad_()
        self.grad = gp.contiguous()
        self.w = base_weight.detach().contiguous()

        def operand(p: Tensor) -> Tensor:  # the caller's leaf if already in the right dtype, else a copy
            if p.dtype == dtype and p.is_leaf and p.requires_grad and p.is_contiguous():
                return p
            return p.detach().to(dtype).contiguous().requires_grad_()

        self.a = [operand(a) for a in weights.a]
        self.b = [operand(b) for b in weights.b]
        self.max_r = _pow2_at_least(max(ranks))
        # LoRAFusion's per-block tables, in the layout of its prepare_multi_lora_batch_info:
        # lookup[blk] = (rank, valid rows in the block, first block of the segment), alpha[blk], dropout_p[blk].
        lookup, alpha = [], []
        for n_rows, p, r, sc in zip(seq, padded, ranks, weights.scaling):
            first = len(lookup)
            for i in range(p // bm):
                lookup.append((r, min(bm, n_rows - i * bm), first))
                alpha.append(sc)
        self.lookup = torch.tensor(lookup, dtype=torch.int32, device=device)
        self.alpha = torch.tensor(alpha, dtype=dtype, device=device)
        self.dropout_p = torch.zeros(len(lookup), dtype=dtype, device=device)
        self.notes = []
        if self.max_r != max(ranks):
            self.notes.append(f"MAX_R {self.max_r} for ranks up to {max(ranks)}")
        if not self.aligned:
            self.notes.append(f"{self.t} rows padded to {self.t_pad}")

    def forward(self) -> Tensor:
        """LoRAFusion's output, ``(1, T_pad, d_out)``; padded rows are left unwritten."""
        return self.lf.fused_linear_multi_lora(
            self.x_leaf, self.w, lora_a_list=list(self.a), lora_b_list=list(self.b), seq_len_list=list(self.seq),
            padded_seq_len_list=list(self.padded), block_to_lookup_table=self.lookup,
            block_to_dropout_p=self.dropout_p, block_to_alpha=self.alpha, enable_dropout=False,
            same_dropout_p_value=0.0, max_r=self.max_r, linear_bias=None)

    def __call__(self) -> None:
        self.x_leaf.grad = None
        y = self.forward()
        torch.autograd.backward(y, self.grad)

    def unpad(self, t: Tensor) -> Tensor:
        """Rows of a ``(1, T_pad, d)`` tensor back in the caller's ``(T, d)`` order."""
        t = t.reshape(self.t_pad, -1)
        return t if self.rows is None else t[self.rows]

    def zero_grad(self) -> None:
        for p in (self.x_leaf, *self.a, *self.b):
            p.grad = None


def _starts(lengths: list[int]) -> list[int]:
    out, row = [], 0
    for n in lengths:
        out.append(row)
        row += n
    return out


def make_lorafusion_step(x: Tensor, base_weight: Tensor, weights: LoRAWeights, grad: Tensor,
                         lf: Optional[LoRAFusion] = None) -> LoRAFusionStep:
    """A zero-argument callable doing one forward + backward of LoRAFusion's fused op on our benchmark problem.

    Args:
        x: ``(T, d_in)`` packed tokens (``make()`` in benchmarks/kernels.py); adapter ``i`` owns rows
            ``[weights.starts[i], weights.ends[i])``.
        base_weight: ``(d_out, d_in)`` frozen weight of the linear, in ``x``'s dtype (LoRAFusion fuses it).
        weights: the adapters (A ``(r, d_in)``, B ``(d_out, r)``, scaling; dropout must be 0).
        grad: ``(T, d_out)`` the output gradient fed to backward.
        lf: a `load_lorafusion` result; default the last one loaded.

    Raises:
        ValueError: the problem is outside what the op supports (more than 4 adapters, too many padded rows,
            widths not multiples of 256, gaps between segments, dropout).
    """
    lf = lf or _last
    if lf is None:
        raise RuntimeError("call load_lorafusion(src) first")
    return LoRAFusionStep(lf, x, base_weight, weights, grad)


# ---------------------------------------------------------------------------------------------------------------
# Check and time


def _rel(got: Tensor, want: Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def check(step: LoRAFusionStep, x: Tensor, base_weight: Tensor, weights: LoRAWeights, grad: Tensor) -> dict:
    """Relative (Frobenius) errors of LoRAFusion's Y, dX (whole, and their LoRA terms alone), dA_i and dB_i (worst
    adapter) against `multi_lora_reference` run in fp32 on the same inputs."""
    from lightning_multilora.kernels import multi_lora_reference

    step.zero_grad()
    with torch.no_grad():
        y = step.unpad(step.forward()).clone()
    step()
    xr = x.detach().float().requires_grad_()
    a = [p.detach().float().requires_grad_() for p in weights.a]
    b = [p.detach().float().requires_grad_() for p in weights.b]
    wr = LoRAWeights(tuple(a), tuple(b), weights.scaling, weights.dropout, weights.starts, weights.ends)
    y_ref = multi_lora_reference(xr, F.linear(xr, base_weight.float()), wr, True)
    torch.autograd.backward(y_ref, grad.float())
    dx = step.unpad(step.x_leaf.grad)
    with torch.no_grad():  # the LoRA terms alone: the frozen product dominates Y and dX at make()'s B scale
        base, dbase = F.linear(xr, base_weight.float()), grad.float() @ base_weight.float()
    return dict(
        y=_rel(y, y_ref),
        dx=_rel(dx, xr.grad),
        y_lora=_rel(y.float() - base, y_ref - base),
        dx_lora=_rel(dx.float() - dbase, xr.grad - dbase),
        da=max(_rel(p.grad, q.grad) for p, q in zip(step.a, a)),
        db=max(_rel(p.grad, q.grad) for p, q in zip(step.b, b)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", default=".lorafusion", help="root of a CentML/lorafusion source tree")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                        help="activation dtype (default bf16 on a GPU, fp32 in the interpreter)")
    parser.add_argument("--d-in", type=int, default=4096)
    parser.add_argument("--d-out", type=int, default=4096)
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 16, 16, 16])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 256, 256, 256])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if len(args.ranks) != len(args.tokens):
        parser.error("--ranks and --tokens need one entry per adapter")

    lf = load_lorafusion(args.src)
    print(f"LoRAFusion from {lf.src}: configs {lf.hardware}, block {lf.block_size_m} rows, at most "
          f"{lf.max_blocks} blocks; stand-ins for {', '.join(lf.stubs) or 'nothing'}")
    for note in lf.notes:
        print(f"  note: {note}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    if not cuda and dtype == torch.bfloat16:
        print("  warning: the Triton interpreter's bf16 arithmetic is not trustworthy; use --dtype float32")
    torch.manual_seed(args.seed)

    from benchmarks.kernels import make

    x, _, w = make(args.d_in, args.d_out, args.ranks, args.tokens, device)
    x = x.to(dtype)
    base_weight = (torch.randn(args.d_out, args.d_in, device=device) / args.d_in ** 0.5).to(dtype)
    grad = torch.randn(x.shape[0], args.d_out, device=device, dtype=dtype)
    step = make_lorafusion_step(x, base_weight, w, grad, lf)
    print(f"{args.d_in}x{args.d_out} N={len(args.ranks)} ranks {args.ranks} tokens {args.tokens} {dtype}"
          + "".join(f"; {n}" for n in step.notes))
    if cuda:  # LoRAFusion's own table builder must agree with ours
        info = lf.multi_lora.prepare_multi_lora_batch_info(
            seq_len_list=step.seq, lora_idx_list=list(range(step.n)), lora_rank_list=list(args.ranks),
            dropout_p_list=[0.0] * step.n, alpha_list=list(w.scaling), block_size_m=lf.block_size_m,
            output_dtype=dtype)
        assert info.padded_seq_len_list == step.padded and torch.equal(info.block_to_lookup_table, step.lookup)
        assert torch.equal(info.block_to_alpha, step.alpha)
    err = check(step, x, base_weight, w, grad)
    print("relative error vs multi_lora_reference (fp32): " + "  ".join(f"{k} {v:.2e}" for k, v in err.items()))
    if not cuda:
        return

    from triton.testing import do_bench

    from benchmarks.kernels import graph_ms
    from lightning_multilora.kernels.triton_lora import multi_lora_linear_triton

    step.zero_grad()
    xg = x.clone().requires_grad_()
    wd = LoRAWeights(w.a, w.b, w.scaling, w.dropout, w.starts, w.ends, direct_grads=True)

    def ours():
        torch.autograd.backward(multi_lora_linear_triton(xg, base_weight, None, wd, True), grad)

    def frozen():
        torch.autograd.backward(F.linear(xg, base_weight), grad)

    for name, fn in (("lorafusion", step), ("ours_linear_direct", ours), ("frozen_linear", frozen)):
        try:
            eager = do_bench(fn, warmup=5, rep=30)
            graphed = graph_ms(fn)
        except Exception as err:  # noqa: BLE001 - report and go on
            print(f"  {name} failed: {type(err).__name__}: {str(err)[:200]}")
            continue
        print(f"  {name:>20}: {graphed:.3f} ms graph-replayed, {eager:.3f} ms eager (fwd + bwd)")


if __name__ == "__main__":
    main()
