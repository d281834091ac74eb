"""The torch baseline: the reference backbone built competently, for the bench
to compare the executor against (vLLM's stock forward cannot run on the GPU box).

The stock math of ``reference.model`` with its plain torch ops (cuBLAS GEMMs,
the routed experts as two grouped GEMMs that read each selected expert once:
``reference.functional.expert_rows``), except the attention core: FlashInfer's
paged attention (fa2 paged prefill of the step's q rows, causal, the sliding
window in the kernel) over the pages the step can see, instead of the
reference's gathered KV. Planned on the host once per step shape, outside the
graph, as a serving engine plans before each replay.

On a machine without CUDA or FlashInfer the attention falls back to the
reference's gathered KV, and the baseline says so (``attention_impl``).

Collectives: on a detached TP rank (no process group) the o_proj all-reduce and
the expert-TP route-row all-reduce are left out (the identity), as the executor
leaves them out; the bench lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..comm import Collectives
from ..protocols import LayerKV
from ..reference import functional as fn
from ..reference import model
from ..reference.kvcache import BLOCK_SIZE, PagedKVCache
from ..weights import ExpertWeights, ModelWeights, Nvfp4MarlinScales, Nvfp4Scales

FLASHINFER_WORKSPACE = 128 << 20  # FlashInfer's recommended split-KV workspace


def flashinfer_version() -> str | None:
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - a broken install is as good as none here
        return None
    return getattr(flashinfer, "__version__", "unknown")


def stock_expert_rows(h: torch.Tensor, ids: torch.Tensor, experts: ExpertWeights) -> torch.Tensor:
    """The routed experts as torch runs them: bf16 experts as the two grouped GEMMs
    (``fn.expert_rows``, each selected expert read once). NVFP4 experts: torch has
    no FP4 GEMM on Hopper, so each route's expert is gathered and dequantized to
    bf16 (nvfp4.dequantize; from Marlin's layout nvfp4_marlin.dequantize, the
    weights Marlin computes with), then batched GEMVs of the same rounding (an
    expert chosen by several routes is read once per route). Bf16 [b, k, P]."""
    if experts.format == "bf16":
        return fn.expert_rows(h, ids, experts.w13, experts.w2, experts.first_expert)
    b, k = ids.shape
    local = ids.reshape(-1).long() - experts.first_expert
    held = (local >= 0) & (local < experts.num_local)
    w13, w2 = routed_experts(experts, local.clamp(0, experts.num_local - 1)).dequantized()
    x = h.repeat_interleave(k, dim=0)  # route r * k + j reads row r
    gate_up = torch.bmm(w13, x[:, :, None])[..., 0]
    y = torch.bmm(w2, fn.swiglu(gate_up, w2.shape[2])[:, :, None])[..., 0]
    return torch.where(held[:, None], y, 0).reshape(b, k, -1)


def routed_experts(experts: ExpertWeights, index: torch.Tensor) -> ExpertWeights:
    """The NVFP4 experts at the local indices ``index`` (one per route, repeats
    allowed), gathered in their own layout with their scales (Marlin's: its
    permutations shared); the activation input scales are left out."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        return t[index]

    w13, w2 = gather(experts.w13), gather(experts.w2)
    if experts.marlin is not None:
        m = experts.marlin
        scales = Nvfp4MarlinScales(
            gather(m.w13_scale), gather(m.w13_global), gather(m.w2_scale), gather(m.w2_global), m.perms
        )
        return ExpertWeights(experts.format, w13, w2, marlin=scales)
    q = experts.nvfp4
    if q is None:
        raise ValueError(f"{experts.format} experts are not NVFP4")
    scales = Nvfp4Scales(gather(q.w13_scale), gather(q.w13_global), gather(q.w2_scale), gather(q.w2_global))
    return ExpertWeights(experts.format, w13, w2, nvfp4=scales)


class FlashInferAttention:
    """FlashInfer's paged prefill (fa2, CUDA-graph mode) over one KV-cache group's
    visible pages: one plan serves every layer of the group. Full layers run the
    same sliding-window kernel with a window past the context (one JIT module
    rather than two; no key is masked by it)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, max_pages: int, rows: int, device):
        import flashinfer

        self.rows, self.num_heads, self.num_kv_heads, self.head_dim = rows, num_heads, num_kv_heads, head_dim
        i32 = dict(dtype=torch.int32, device=device)
        self.workspace = torch.empty(FLASHINFER_WORKSPACE, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indptr_buf=torch.zeros(2, **i32),
            paged_kv_indices_buf=torch.zeros(max_pages, **i32),
            paged_kv_last_page_len_buf=torch.zeros(1, **i32),
            backend="fa2",
        )
        self.out = torch.empty(rows, num_heads, head_dim, dtype=torch.bfloat16, device=device)

    def plan(self, pages: list[int], first_visible: int, context: int, window: int | None, scale: float) -> None:
        """``pages``: the request's pages (page i holds positions 16i..16i+15); the
        step's last query is at ``context - 1``, its first visible key at
        ``first_visible``. Positions in FlashInfer are relative to the first page
        given; the causal and window masks are relative too, so they agree."""
        first_page = max(first_visible, 0) // BLOCK_SIZE
        used = pages[first_page : (context - 1) // BLOCK_SIZE + 1]
        kv_len = context - first_page * BLOCK_SIZE
        last_len = kv_len - (len(used) - 1) * BLOCK_SIZE
        window_left = window - 1 if window is not None else kv_len
        self.wrapper.plan(
            torch.tensor([0, self.rows], dtype=torch.int32),
            torch.tensor([0, len(used)], dtype=torch.int32),
            torch.tensor(used, dtype=torch.int32),
            torch.tensor([last_len], dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            BLOCK_SIZE,
            causal=True,
            sm_scale=scale,
            window_left=window_left,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
            o_data_type=torch.bfloat16,
            uniform_q_len=self.rows,
        )

    def run(self, q: torch.Tensor, kv: LayerKV) -> torch.Tensor:
        return self.wrapper.run(q.contiguous(), (kv.k, kv.v), out=self.out)


class TorchBaseline:
    """One verify step of ``rows`` tokens at positions ``context - rows ..
    context - 1`` over ``cache`` (filled and its metadata set by the caller).

    ``step()`` runs the whole step functionally (no copies between blocks) and
    writes the bf16 normed hidden states into ``out``; the block methods are the
    same step cut where the executor's blocks are cut, for per-block timing."""

    def __init__(
        self,
        weights: ModelWeights,
        cache: PagedKVCache,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: int,
        use_flashinfer: bool,
    ):
        self.weights, self.spec = weights, weights.spec
        self.tokens, self.positions, self.context = tokens, positions, context
        self.rows = tokens.shape[0]
        self.kv = cache.kv()
        # A TP shard with no group: the collectives are the identity (left out).
        self.collectives = Collectives(weights.tp, weights.rank, None)
        self.out = torch.empty(self.rows, self.spec.H, dtype=torch.bfloat16, device=weights.device)
        self.rope = [
            weights.rope_table(layer.rope_theta, context) if layer.rope_theta > 0 else None for layer in weights.layers
        ]
        # The step's routing, written only by ``record_routing`` (never in a timed graph).
        self.routing: list[torch.Tensor] | None = None
        self.attention_impl = "reference gathered KV (FlashInfer needs CUDA)"
        self.fi: dict[int, FlashInferAttention] = {}
        if use_flashinfer:
            layer0 = weights.layers[0]
            first = context - self.rows
            for group in cache.groups:
                attn = FlashInferAttention(
                    layer0.num_heads,
                    layer0.num_kv_heads,
                    self.spec.head_dim,
                    cache.max_pages,
                    self.rows,
                    weights.device,
                )
                first_visible = 0 if group.window is None else first - group.window + 1
                attn.plan(group.pages, first_visible, context, group.window, self.spec.softmax_scale)
                for layer in group.layers:
                    self.fi[layer] = attn
            self.attention_impl = f"FlashInfer {flashinfer_version()} fa2 paged prefill (CUDA-graph plan, split-KV)"

    # The blocks, cut as the executor cuts them.
    def embed(self) -> torch.Tensor:
        return self.weights.embed.index_select(0, self.tokens)

    def boundary(self, i: int, stream: torch.Tensor | None, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 0: the front of the embedded rows ``x``; later layers: the input
        boundary of the previous MoE output ``x``."""
        layers = self.weights.layers
        if i == 0:
            return model.front(self.spec, x, False, layers[0])
        assert stream is not None
        return model.input_boundary(self.spec, stream, x, layers[i - 1], layers[i])

    def attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        spec, layer, kv = self.spec, self.weights.layers[i], self.kv[i]
        if i not in self.fi:
            return model.attention(spec, layer, x, self.positions, kv, self.rope[i], self.context)
        q, gate = model.qkv_front(spec, layer, x, self.positions, kv, self.rope[i])
        o = fn.o_norm_gate(self.fi[i].run(q, kv), gate, spec.rms_norm_eps)
        return fn.linear(o.reshape(x.shape[0], -1), layer.o_proj)

    def attention_boundary(self, i: int, stream: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return model.attention_boundary(self.spec, self.weights.layers[i], stream, self.collectives.all_reduce(a))

    def moe(self, i: int, xf: torch.Tensor) -> torch.Tensor:
        spec, layer = self.spec, self.weights.layers[i]
        ids, weights = fn.route(
            model.router_logits(layer, xf), layer.expert_bias, spec.top_k, spec.routed_scaling_factor
        )
        if self.routing is not None:
            self.routing[i].copy_(ids)
        h = model.pool(spec, layer, xf, self.collectives)
        rows = stock_expert_rows(h, ids, layer.experts)
        m = model.moe_tail(spec, layer, rows, weights, self.collectives.all_reduce)
        f = fn.linear(m, layer.unpooler)
        if f.shape[-1] != spec.H:  # a column-sharded unpooler: the next boundary gathers
            f = self.collectives.gather_columns(f, spec.H)
        return f

    def final(self, stream: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        layers = self.weights.layers
        return model.final_boundary(self.spec, stream, f, layers[-1], self.weights.final_norm)[1]

    def step(self, inputs: dict[str, Any] | None = None) -> None:
        """The whole step into ``out``; ``inputs`` (when given) receives every block's
        inputs by block name, for the per-block graphs."""
        stream, x = None, self.embed()
        f = x
        for i in range(self.spec.num_layers):
            if inputs is not None:
                inputs[f"boundary.{i}"] = (stream, f)
            stream, x = self.boundary(i, stream, f)
            if inputs is not None:
                inputs[f"attention.{i}"] = (x,)
            a = self.attention(i, x)
            if inputs is not None:
                inputs[f"attention_boundary.{i}"] = (stream, a)
            stream, xf = self.attention_boundary(i, stream, a)
            if inputs is not None:
                inputs[f"moe.{i}"] = (xf,)
            f = self.moe(i, xf)
        assert stream is not None
        if inputs is not None:
            inputs["final"] = (stream, f)
        self.out.copy_(self.final(stream, f))

    def blocks(self) -> list[tuple[str, Callable[[], Any]]]:
        """Every block as a closure over its inputs from one eager step (cloned, so
        replaying a block alone leaves the others' inputs as they were)."""
        inputs: dict[str, Any] = {}
        self.step(inputs)
        saved = {name: tuple(None if t is None else t.clone() for t in args) for name, args in inputs.items()}
        out: list[tuple[str, Callable[[], Any]]] = [("embed", self.embed)]
        for i in range(self.spec.num_layers):
            out += [
                (f"boundary.{i}", lambda i=i: self.boundary(i, *saved[f"boundary.{i}"])),
                (f"attention.{i}", lambda i=i: self.attention(i, *saved[f"attention.{i}"])),
                (f"attention_boundary.{i}", lambda i=i: self.attention_boundary(i, *saved[f"attention_boundary.{i}"])),
                (f"moe.{i}", lambda i=i: self.moe(i, *saved[f"moe.{i}"])),
            ]
        out.append(("final", lambda: self.final(*saved["final"])))
        return out

    def attention_error(self) -> float:
        """The largest ||baseline - reference|| / ||reference|| over the layers of the
        attention block's output (o_proj partial) on identical inputs from one eager
        step: the baseline's paged attention checked against the reference's gathered
        KV at this step's shapes (0 where the baseline runs the reference's)."""
        inputs: dict[str, Any] = {}
        self.step(inputs)
        worst = 0.0
        for i, layer in enumerate(self.weights.layers):
            (x,) = inputs[f"attention.{i}"]
            ours = self.attention(i, x).float()
            ref = model.attention(self.spec, layer, x, self.positions, self.kv[i], self.rope[i], self.context).float()
            worst = max(worst, ((ours - ref).norm() / ref.norm()).item())
        return worst

    def record_routing(self) -> list[torch.Tensor]:
        """One eager step that keeps each layer's expert ids (int32 [rows, k])."""
        spec = self.spec
        self.routing = [
            torch.empty(self.rows, spec.top_k, dtype=torch.int32, device=self.out.device)
            for _ in range(spec.num_layers)
        ]
        try:
            self.step()
        finally:
            routing, self.routing = self.routing, None
        return routing
