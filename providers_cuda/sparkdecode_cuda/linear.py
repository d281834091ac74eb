"""Sub-op ``linear``: the layer's five dense GEMMs streamed by tensor-core MMA
(kernels/linear.cu): mma.sync m16n8k16 with the weights as the 16-row A operand and
the (up to) 8 rows of x as B, one kernel compiled per weight shape and tiling,
launched with programmatic dependent launch so the first weight loads are in flight
while the kernel before finishes.

Tiling (``plan``): a CTA of 8 warps owns 16 * tm * wm rows and a K-slice; ``splits``
CTAs of a thread-block cluster split K and add their partials through distributed
shared memory (no workspace, no counters). The plan minimises a model of the
stream's time on the GPU's SMs (two CTAs each): whole waves at the copy bandwidth,
a partial last wave at the rate its CTAs can keep in flight.

Numerics against ``reference.linear`` (cuBLAS): the bf16 products accumulated in
fp32 (the MMA's sums, then the warps' and CTAs' partials in a fixed order), rounded
once to bf16; so within test_gpu_cute_pack's bounds (half a bf16 ulp of the exact
product plus the fp32 accumulation term), and the same bits on every run. The fp32
router splits each weight exactly into three bf16 parts (hi + mid + lo, exact for
|w| >= 2^-109) and accumulates their products in fp32: the fp32 GEMM's result up to
fp32 rounding of the sums (relative ~1e-6 of the row's magnitude), no bf16 rounding.

Needs SM90: thread-block clusters and their shared memory, griddepcontrol. Checked
on the H200 by tests/test_gpu_cuda_linear.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparkdecode.protocols import LINEAR_WEIGHTS, BuildContext, Deployment

from .boundary import _Cuda, cuda_unsupported
from .lamport import LamportWorkspace
from .launch import Kernel, i32, ptr

SOURCE = "linear.cu"
COMPILE_OPTIONS = ("--fmad=false",)
MAX_ROWS = 8  # the MMA's n
THREADS = 256
WARPS = 8
MAX_SLICE = 2048  # k of x a CTA stages in shared memory (static, under 48 KiB)
MAX_SPLITS = 8  # a portable cluster
CTAS_PER_SM = 2  # __launch_bounds__(256, 2)
MAX_LOADS = 16  # 16-byte weight loads a thread holds in flight
# The stream model (H200): copy bandwidth, memory latency, a CTA's fixed cost (launch,
# x staged, the partials added) in seconds.
BANDWIDTH = 4.0e12
LATENCY = 1.0e-6
CTA_COST = 1.5e-6


@dataclass(frozen=True)
class Plan:
    """One weight's tiling: N x K, fp32 (the router) or bf16; tm tiles of 16 rows per
    warp, wm warps along the rows (8 / wm along K), ``splits`` CTAs a cluster along
    K, ``depth`` chunks of loads in flight a thread."""

    n: int
    k: int
    fp32: bool
    tm: int
    wm: int
    splits: int
    depth: int

    @property
    def rows(self) -> int:  # a CTA's
        return 16 * self.tm * self.wm

    @property
    def ctas(self) -> int:
        return self.n // self.rows * self.splits

    @property
    def chunk(self) -> int:  # k of a warp's chunk: 4 lanes of 16 bytes
        return 16 if self.fp32 else 32

    def defines(self) -> dict[str, int | str]:
        return {
            "N_DIM": self.n,
            "K_DIM": self.k,
            "TM": self.tm,
            "WM": self.wm,
            "SPLITS": self.splits,
            "DEPTH": self.depth,
            "W_FP32": int(self.fp32),
        }

    def seconds(self, sms: int) -> float:
        """The modelled stream time on ``sms`` SMs."""
        element = 4 if self.fp32 else 2
        cta_bytes = self.rows * (self.k // self.splits) * element
        in_flight = THREADS * 2 * self.tm * self.depth * 16
        cta_time = CTA_COST + cta_bytes / (in_flight / LATENCY)
        slots = CTAS_PER_SM * sms
        waves, tail = divmod(self.ctas, slots)
        total = waves * max(slots * cta_bytes / BANDWIDTH, cta_time)
        if tail:
            total += max(tail * cta_bytes / BANDWIDTH, cta_time)
        return total


def plans(n: int, k: int, fp32: bool) -> list[Plan]:
    """Every tiling the kernel takes for an N x K weight."""
    out = []
    chunk = 16 if fp32 else 32
    for tm in (1, 2):
        for wm in (1, 2, 4, 8):
            if n % (16 * tm * wm):
                continue
            for splits in (1, 2, 4, 8):
                slice_k = k // splits
                if k % splits or slice_k > MAX_SLICE or (16 * tm * wm) % splits:
                    continue
                for depth in (1, 2, 4, 8):
                    if 2 * tm * depth > MAX_LOADS:
                        continue
                    if slice_k % (WARPS // wm * chunk * depth) == 0:
                        out.append(Plan(n, k, fp32, tm, wm, splits, depth))
    return out


def plan(n: int, k: int, fp32: bool, sms: int) -> Plan:
    """The fastest tiling by the model (to 10 ns; ties: a CTA on every SM, fewer
    splits, more rows a CTA, deeper)."""
    candidates = plans(n, k, fp32)
    if not candidates:
        raise ValueError(shape_unsupported("weight", n, k, fp32))
    return _fastest(candidates, sms)


def _fastest(candidates: list[Plan], sms: int) -> Plan:
    """The model's fastest of ``candidates`` (``plan``'s order)."""
    return min(candidates, key=lambda p: (round(p.seconds(sms), 8), p.ctas < sms, p.splits, -p.rows, -p.depth))


def publishing_plan(n: int, k: int, sms: int) -> Plan | None:
    """The fastest tiling by the model of a bf16 weight whose epilogue publishes into the
    Lamport mailbox (linear.cu's PUBLISH: 16-byte vectors of a CTA's share of rows), or
    None when no tiling has such shares."""
    candidates = [p for p in plans(n, k, False) if (p.rows // p.splits) % 8 == 0]
    return _fastest(candidates, sms) if candidates else None


def shape_unsupported(name: str, n: int, k: int, fp32: bool) -> str | None:
    """Why the kernel takes no tiling of this N x K weight, or None."""
    if plans(n, k, fp32):
        return None
    chunk = 16 if fp32 else 32
    return (
        f"{name} {n} x {k}: cuda.linear takes N a multiple of 16 and K a multiple of "
        f"{WARPS * chunk} up to {MAX_SPLITS * MAX_SLICE}"
    )


def deployment_shapes(d: Deployment) -> dict[str, tuple[int, int]]:
    """Each dense weight's (N, K) on one rank (weights.py's shards)."""
    s, tp = d.spec, d.tp
    return {
        "qkvg": ((2 * s.q_size + 2 * s.kv_size) // tp, s.H),
        "o_proj": (s.H, s.q_size // tp),
        "router": (s.E, s.H),
        "pooler": (s.P // tp if d.shard_pooler else s.P, s.H),
        "unpooler": (s.H // tp if d.shard_unpooler else s.H, s.P),
    }


class _Weight:
    """One weight, its plan and compiled kernel."""

    def __init__(self, name: str, w: torch.Tensor, max_rows: int, sms: int, chosen: Plan | None = None):
        """``chosen``: a plan of ``w``'s shape in place of the model's best."""
        if w.dim() != 2 or w.stride(1) != 1 or w.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"cuda.linear: {name} is {tuple(w.shape)} {w.dtype} strides {w.stride()}")
        if w.stride(0) != w.shape[1] or w.data_ptr() % 16:
            raise ValueError(f"cuda.linear: {name} must be contiguous and 16-byte aligned")
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"cuda.linear: max_rows {max_rows} (1..{MAX_ROWS})")
        self.name, self.w = name, w
        self.fp32 = w.dtype == torch.float32
        self.plan = chosen or plan(w.shape[0], w.shape[1], self.fp32, sms)
        if (self.plan.n, self.plan.k, self.plan.fp32) != (w.shape[0], w.shape[1], self.fp32):
            raise ValueError(f"cuda.linear: {name} {tuple(w.shape)} {w.dtype} under a plan for {self.plan}")
        self.kernel = Kernel(SOURCE, "linear_kernel", w.device, self.plan.defines(), COMPILE_OPTIONS)
        self.sms = sms
        self.mailbox: LamportWorkspace | None = None  # set by publish()

    def publish(self, mailbox: LamportWorkspace) -> bool:
        """From now on every call also publishes its output into ``mailbox`` (this
        rank's slot of the current generation in every peer, at row * N + column), for
        the next Lamport kernel to gather. False (nothing changes) where this weight
        cannot: the fp32 router, no tiling with 16-byte shares, or a slot too small."""
        n, k = self.w.shape
        chosen = None if self.fp32 else publishing_plan(n, k, self.sms)
        if chosen is None or MAX_ROWS * n > mailbox.capacity:
            return False
        defines = {**chosen.defines(), "PUBLISH": 1}
        self.plan, self.mailbox = chosen, mailbox
        self.kernel = Kernel(SOURCE, "linear_kernel", self.w.device, defines, COMPILE_OPTIONS)
        return True

    def check(self, x: torch.Tensor, out: torch.Tensor) -> None:
        b, (n, k) = x.shape[0], self.w.shape
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
            raise ValueError(f"cuda.linear {self.name}: x {tuple(x.shape)} {x.dtype} is not bf16 [b, {k}] rows")
        if out.dtype != self.w.dtype or tuple(out.shape) != (b, n) or out.stride(1) != 1:
            raise ValueError(
                f"cuda.linear {self.name}: out {tuple(out.shape)} {out.dtype} is not {self.w.dtype} [{b}, {n}] rows"
            )
        if not 1 <= b <= MAX_ROWS:
            raise ValueError(f"cuda.linear {self.name}: {b} rows (1..{MAX_ROWS})")

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.check(x, out)
        args = [ptr(self.w), ptr(x), i32(x.stride(0)), i32(x.shape[0]), ptr(out), i32(out.stride(0))]
        if self.mailbox is not None:
            if out.stride(0) % 8 or out.data_ptr() % 16:
                raise ValueError(f"cuda.linear {self.name}: a published output takes 16-byte-aligned rows")
            args += self.mailbox.args()
        self.kernel.launch((self.plan.ctas, 1, 1), (THREADS, 1, 1), args)


class CudaLinear(_Cuda):
    """Sub-op ``linear``: every dense weight of the layer streamed by linear_kernel."""

    block = "linear"
    name = "cuda.linear"

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        d = deployment
        reason = cuda_unsupported(d)
        if reason is None and not 1 <= d.max_rows <= MAX_ROWS:
            reason = f"{d.max_rows} rows a step: cuda.linear takes 1..{MAX_ROWS}"
        for name, (n, k) in deployment_shapes(d).items():
            reason = reason or shape_unsupported(name, n, k, name == "router")
        return reason

    def __init__(self, ctx: BuildContext, layer: int):
        lw = ctx.layer(layer)
        device = lw.qkvg.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.weights = {name: _Weight(name, getattr(lw, name), ctx.max_rows, sms) for name in LINEAR_WEIGHTS}

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaLinear:
        assert layer is not None
        return cls(ctx, layer)

    def publish(self, name: str, mailbox: LamportWorkspace) -> bool:
        """Weight ``name``'s output published into ``mailbox`` by its epilogue from now
        on (``_Weight.publish``); whether it will be."""
        return self.weights[name].publish(mailbox)

    def run(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        self.weights[name](x, out)
