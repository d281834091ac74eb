"""The boundaries as one CUDA kernel each (kernels/boundary.cu): post-norm of the
branch, the gated add into the fp32 stream in place, the next pre-norm into bf16,
and the aux stream where the drafter reads it.

Against the reference: the elementwise math is the same sequence of fp32 operations
(compiled without FMA contraction, as torch's separate elementwise kernels round);
the two row reductions (mean of squares) sum in another order, so the stream
differs by fp32 rounding (relative 1e-6) and a bf16 output by at most one ulp
where that moves a value across a rounding boundary.

At TP > 1 the attention boundary is one kernel with the all-reduce fused in front
(attention_boundary_all_reduce_kernel): the one-shot Lamport all-reduce of the
o_proj partial (lamport.py; the same bits as the reference transport), then the
same code as boundary_kernel's mode 3. Where the unpooler is column-sharded and the
resolved transport gathers on the device (``lamport.device_gather``), the input and
final boundaries are likewise one kernel (boundary_columns_kernel): the Lamport
exchange of every rank's column block, then mode 2's code.
"""

from __future__ import annotations

import torch

from sparkdecode.protocols import BuildContext, Deployment, LayerKV, Mailbox, Step

from .lamport import collective_setup as lamport_setup
from .lamport import device_gather, lamport_unsupported, workspace
from .launch import Kernel, f32, i32, ptr
from .nvrtc import nvrtc_unavailable

# Each thread holds ITEMS consecutive values of a row (16 bytes of bf16). The plain
# boundary kernel spreads a row over a cluster of up to MAX_CLUSTER blocks of at least
# MIN_THREADS threads (H 8192: 8 blocks of 128), so a row's bytes stream through several
# SMs; the fused all-reduce kernel keeps one block a row (H / ITEMS threads).
ITEMS = 8
MAX_CLUSTER = 8
MIN_THREADS = 128
SOURCE = "boundary.cu"
# Modes of boundary_kernel (see the source).
FRONT_EMBED, FRONT_NORMED, INPUT_SCALE_POST, WEIGHTLESS_POST = 0, 1, 2, 3
COMPILE_OPTIONS = ("--fmad=false",)


def cuda_unsupported(d: Deployment) -> str | None:
    """What every kernel of this pack needs: a Hopper (or newer) GPU and NVRTC."""
    if d.device != "cuda" or d.capability is None:
        return "needs a CUDA GPU"
    if d.capability < (9, 0):
        return f"needs SM90 (Hopper) or newer, this GPU is SM{d.capability[0]}{d.capability[1]}"
    if d.libraries.get("cuda.bindings") is None:
        return "cuda-python (cuda-bindings) is not installed"
    return nvrtc_unavailable()


def _width_unsupported(width: int) -> str | None:
    threads = width // ITEMS
    if width % (ITEMS * 32) or threads > 1024:
        return f"hidden size {width}: the boundary kernel takes multiples of {ITEMS * 32} up to {1024 * ITEMS}"
    return None


def row_cluster(width: int) -> int:
    """The blocks of boundary_kernel's cluster a row: the most (a power of two, at most
    MAX_CLUSTER) that leave each at least MIN_THREADS threads and whole warps."""
    cluster = MAX_CLUSTER
    while cluster > 1 and (width % (ITEMS * 32 * cluster) or width // (ITEMS * cluster) < MIN_THREADS):
        cluster //= 2
    return cluster


def kernel_defines(width: int, pdl_trigger: int = 0) -> dict[str, int]:
    """boundary_kernel's defines for hidden size ``width`` (its row cluster included),
    with the source's PDL_TRIGGER where not its default 0."""
    cluster = row_cluster(width)
    defines = {"H": width, "THREADS": width // ITEMS // cluster}
    if cluster > 1:
        defines["CLUSTER"] = cluster
    return _with_trigger(defines, pdl_trigger)


def fused_defines(width: int, pdl_trigger: int = 0) -> dict[str, int]:
    """attention_boundary_all_reduce_kernel's defines for hidden size ``width`` (a block a
    row), with PDL_TRIGGER as ``kernel_defines``."""
    return _with_trigger({"H": width, "THREADS": width // ITEMS}, pdl_trigger)


def _with_trigger(defines: dict[str, int], pdl_trigger: int) -> dict[str, int]:
    return {**defines, "PDL_TRIGGER": pdl_trigger} if pdl_trigger else defines


def check_aligned(name: str, t: torch.Tensor | None, strided: bool = False) -> None:
    """The kernel loads and stores 8 values (16 or 32 bytes) at a time: every tensor
    16-byte aligned and contiguous, or (``strided``: x) rows of contiguous values at a
    16-byte-multiple stride."""
    if t is None:
        return
    rows_ok = t.stride(-1) == 1 and t.stride(0) * t.element_size() % 16 == 0 if strided else t.is_contiguous()
    if t.data_ptr() % 16 or not rows_ok:
        raise ValueError(f"this pack's row kernels take 16-byte-aligned rows; {name} has strides {t.stride()}")


def row_arguments(
    x_name: str,
    x: torch.Tensor,
    stream: torch.Tensor,
    out: torch.Tensor,
    aux: torch.Tensor | None,
    post_weight: torch.Tensor | None,
    alpha: torch.Tensor | None,
    beta: torch.Tensor | None,
    next_weight: torch.Tensor,
    eps_post: float,
    eps_next: float,
) -> list:
    """The arguments boundary_kernel and boundary_columns_kernel begin with (the row's
    input, named ``x_name`` in an error, its stride, the stream and outputs, the weights,
    the two epsilons), every tensor checked for the kernels' 16-byte accesses."""
    check_aligned(x_name, x, strided=True)
    weights = (("post_weight", post_weight), ("alpha", alpha), ("beta", beta), ("next_weight", next_weight))
    for name, t in (("stream", stream), ("out", out), ("aux", aux), *weights):
        check_aligned(name, t)
    tensors = (stream, out, aux, post_weight, alpha, beta, next_weight)
    return [ptr(x), i32(x.stride(0)), *(ptr(t) for t in tensors), f32(eps_post), f32(eps_next)]


class _BoundaryKernel:
    """boundary_kernel compiled for this width (a row: ``cluster`` blocks of ``threads``)."""

    def __init__(self, ctx: BuildContext, pdl_trigger: int = 0):
        self.width = ctx.spec.H
        self.threads = self.width // ITEMS  # a row's threads (the fused kernel's block)
        defines = kernel_defines(self.width, pdl_trigger)
        self.cluster, self.block = defines.get("CLUSTER", 1), defines["THREADS"]
        self.kernel = Kernel(SOURCE, "boundary_kernel", ctx.device, defines, COMPILE_OPTIONS)

    def __call__(
        self,
        mode: int,
        x: torch.Tensor,
        stream: torch.Tensor,
        out: torch.Tensor,
        aux: torch.Tensor | None,
        post_weight: torch.Tensor | None,
        alpha: torch.Tensor | None,
        beta: torch.Tensor | None,
        next_weight: torch.Tensor,
        eps_post: float,
        eps_next: float,
        next_center: float,
    ) -> None:
        rows = row_arguments("x", x, stream, out, aux, post_weight, alpha, beta, next_weight, eps_post, eps_next)
        self.kernel.launch((x.shape[0] * self.cluster, 1, 1), (self.block, 1, 1), [*rows, f32(next_center), i32(mode)])


class _ColumnsKernel:
    """boundary_columns_kernel (mode 2 on the row gathered from every rank's column
    block of a sharded unpooler's mailbox over the Lamport workspace), where the
    resolved transport gathers on the device and ``mailbox`` is column-sharded; the
    same bits as the reference transport's gather then boundary_kernel where that runs
    one block a row (H up to 1024), the row sums in another order above."""

    def __init__(self, ctx: BuildContext, mailbox: Mailbox):
        self.width = ctx.spec.H
        self.workspace = workspace(ctx)
        self.published = False  # the unpooler's epilogue pushes this rank's block (pair)
        cols = mailbox.publish(1).shape[1]
        if cols % ITEMS:  # unreachable past _width_unsupported (H a multiple of 256, TP up to 8)
            raise ValueError(f"a rank's {cols} unpooler columns: the fused boundary takes multiples of {ITEMS}")
        self.kernel = Kernel(SOURCE, "boundary_columns_kernel", ctx.device, fused_defines(self.width), COMPILE_OPTIONS)

    @staticmethod
    def wanted(ctx: BuildContext, mailbox: Mailbox) -> bool:
        """Whether a boundary reading ``mailbox`` runs this kernel: a column-sharded
        mailbox and a transport that gathers on the device."""
        return mailbox.publish(1).shape[1] != ctx.spec.H and device_gather(ctx) is not None

    def pair(self, producer: object) -> None:
        """Ask the MoE that publishes into the mailbox (and runs right before this
        kernel) to push this rank's block from its unpooler's epilogue
        (``publish_columns``, where the MoE provider has one); if it does, this kernel
        only takes the peers' blocks. The same bits either way."""
        publish = getattr(producer, "publish_columns", None)
        self.published = bool(publish is not None and publish(self.workspace))

    def __call__(
        self,
        block: torch.Tensor,
        stream: torch.Tensor,
        out: torch.Tensor,
        aux: torch.Tensor | None,
        post_weight: torch.Tensor,
        alpha: torch.Tensor,
        beta: torch.Tensor,
        next_weight: torch.Tensor,
        eps_post: float,
        eps_next: float,
        next_center: float,
    ) -> None:
        ws = self.workspace
        assert ws is not None
        rows = row_arguments(
            "block", block, stream, out, aux, post_weight, alpha, beta, next_weight, eps_post, eps_next
        )
        self.kernel.launch(
            (block.shape[0], 1, 1),
            (self.width // ITEMS, 1, 1),
            [*rows, f32(next_center), i32(int(self.published)), *ws.args()],
        )


class _Cuda:
    priority = 10

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return cuda_unsupported(deployment) or _width_unsupported(deployment.spec.H)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        pass


class CudaBoundary(_Cuda):
    """Layer 0: the front (embedding norm, or the bf16 normed embeddings, into the
    stream, and pre_qkv_proj_norm); later layers: the input boundary."""

    block = "boundary"
    name = "cuda.boundary"

    def __init__(self, ctx: BuildContext, layer: int):
        self.spec = ctx.spec
        self.layer = ctx.layer(layer)
        self.prev = ctx.layer(layer - 1) if layer > 0 else None
        self.embeddings = ctx.buffers["embeddings"]
        self.mailbox = ctx.mailboxes[layer - 1] if layer > 0 else None
        # A sharded unpooler's mailbox gathered on the device: in this kernel.
        self.fused = None
        if self.mailbox is not None and _ColumnsKernel.wanted(ctx, self.mailbox):
            self.fused = _ColumnsKernel(ctx, self.mailbox)
        self.kernel = _BoundaryKernel(ctx)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaBoundary:
        assert layer is not None
        return cls(ctx, layer)

    def pair_producer(self, moe: object) -> None:
        """The previous layer's MoE, once both are built (BoundaryProvider.pair_producer):
        where this boundary takes a sharded unpooler's columns itself, the unpooler may
        push them from its epilogue."""
        if self.fused is not None:
            self.fused.pair(moe)

    def run(self, step: Step, stream: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> None:
        spec, b = self.spec, step.rows
        if self.prev is None:
            mode = FRONT_NORMED if step.normed_embeddings else FRONT_EMBED
            x, post, alpha, beta = self.embeddings[:b], None, None, None
        else:
            assert self.mailbox is not None
            post, alpha, beta = self.prev.post_ffn_norm, self.prev.ffn_alpha, self.prev.ffn_beta
            if self.fused is not None:
                block = self.mailbox.publish(b)
                eps = (spec.post_norm_eps, spec.rms_norm_eps)
                self.fused(block, stream, out, aux, post, alpha, beta, self.layer.pre_qkv_norm, *eps, 1.0)
                return
            mode, x = INPUT_SCALE_POST, self.mailbox.gather(b)
        eps_post = spec.rms_norm_eps if self.prev is None else spec.post_norm_eps
        self.kernel(
            mode, x, stream, out, aux, post, alpha, beta, self.layer.pre_qkv_norm, eps_post, spec.rms_norm_eps, 1.0
        )


class CudaAttentionBoundary(_Cuda):
    """post_attn_norm (weightless), the gated add, pre_ffn_norm; at TP > 1 after the
    one-shot all-reduce of the partial, fused into the same kernel."""

    block = "attention_boundary"
    name = "cuda.attention_boundary"
    # boundary.cu's PDL_TRIGGER: 0, the dependents launched at the kernel's start; 1, once
    # the o_proj's output has arrived (the unregistered ``_late_trigger`` variant).
    pdl_trigger = 0

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return super().unsupported(deployment) or lamport_unsupported(deployment)

    collective_setup = classmethod(lamport_setup)

    def __init__(self, ctx: BuildContext, layer: int):
        self.spec, self.layer = ctx.spec, ctx.layer(layer)
        self.kernel = _BoundaryKernel(ctx, self.pdl_trigger)
        self.workspace = workspace(ctx)  # None at TP 1 and on a detached rank
        self.published = False  # the layer's attention publishes its partial (pair_attention)
        if self.workspace is not None:
            defines = fused_defines(self.kernel.width, self.pdl_trigger)
            self.fused = Kernel(SOURCE, "attention_boundary_all_reduce_kernel", ctx.device, defines, COMPILE_OPTIONS)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaAttentionBoundary:
        assert layer is not None
        return cls(ctx, layer)

    def pair_attention(self, attention: object) -> None:
        """Called by the executor once this layer's attention block is built beside this
        boundary: at TP > 1, ask it to publish its o_proj partial into this rank's
        Lamport slots from the GEMM's epilogue (``publish_partial``, where the attention
        provider has one); if it does, the fused kernel only gathers. The same bits
        either way (the pushed values are the partial's)."""
        publish = getattr(attention, "publish_partial", None)
        if self.workspace is not None and publish is not None:
            self.published = bool(publish(self.workspace))

    def run(self, partial: torch.Tensor, stream: torch.Tensor, out: torch.Tensor) -> None:
        s, w = self.spec, self.layer
        if self.workspace is not None:
            self._run_fused(partial, stream, out)
            return
        self.kernel(
            WEIGHTLESS_POST,
            partial,
            stream,
            out,
            None,
            None,
            w.attn_alpha,
            w.attn_beta,
            w.pre_ffn_norm,
            s.post_norm_eps,
            s.rms_norm_eps,
            1.0,
        )

    def _run_fused(self, partial: torch.Tensor, stream: torch.Tensor, out: torch.Tensor) -> None:
        s, w, ws = self.spec, self.layer, self.workspace
        assert ws is not None
        if partial.stride(1) != 1 or partial.stride(0) % 8 or partial.data_ptr() % 16:
            raise ValueError(f"the fused attention boundary takes 16-byte-aligned bf16 rows, got {partial.stride()}")
        self.fused.launch(
            (partial.shape[0], 1, 1),
            (self.kernel.threads, 1, 1),
            [
                ptr(partial),
                i32(partial.stride(0)),
                ptr(stream),
                ptr(out),
                ptr(w.attn_alpha),
                ptr(w.attn_beta),
                ptr(w.pre_ffn_norm),
                f32(s.post_norm_eps),
                f32(s.rms_norm_eps),
                i32(int(self.published)),
                *ws.args(),
            ],
        )


class CudaAttentionBoundaryLateTrigger(CudaAttentionBoundary):
    """cuda.attention_boundary with its dependents (the pooler, and the router beside it)
    launched only once the o_proj's output (at TP > 1 the gathered partials) has arrived
    (PDL_TRIGGER 1), so its reads are not queued behind the GEMMs' first weight loads.
    The same code after the trigger, so the same bits. Not registered: level with
    cuda.attention_boundary in the 40-layer step on an H100 (bench/NOTES.md v53); the
    same trigger in the input boundary was behind and is removed."""

    name = "cuda.attention_boundary_late_trigger"
    pdl_trigger = 1


class CudaFinal(_Cuda):
    """The last boundary with model.norm (its weight as stored)."""

    block = "final"
    name = "cuda.final"

    def __init__(self, ctx: BuildContext):
        self.spec, self.prev = ctx.spec, ctx.layer(ctx.spec.num_layers - 1)
        self.norm = ctx.weights.final_norm
        self.mailbox = ctx.mailboxes[-1]
        self.fused = _ColumnsKernel(ctx, self.mailbox) if _ColumnsKernel.wanted(ctx, self.mailbox) else None
        self.kernel = _BoundaryKernel(ctx)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaFinal:
        return cls(ctx)

    def pair_producer(self, moe: object) -> None:
        """The last layer's MoE, as CudaBoundary.pair_producer."""
        if self.fused is not None:
            self.fused.pair(moe)

    def run(self, step: Step, stream: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> None:
        s, p = self.spec, self.prev
        if self.fused is not None:
            block = self.mailbox.publish(step.rows)
            args = (p.post_ffn_norm, p.ffn_alpha, p.ffn_beta, self.norm, s.post_norm_eps, s.rms_norm_eps, 0.0)
            self.fused(block, stream, out, aux, *args)
            return
        self.kernel(
            INPUT_SCALE_POST,
            self.mailbox.gather(step.rows),
            stream,
            out,
            aux,
            p.post_ffn_norm,
            p.ffn_alpha,
            p.ffn_beta,
            self.norm,
            s.post_norm_eps,
            s.rms_norm_eps,
            0.0,
        )
