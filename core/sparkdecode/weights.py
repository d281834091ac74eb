"""Plain per-rank weights: what every provider builds from.

``LayerWeights`` holds one layer's tensors of one rank in the layout vLLM keeps
after loading (Q/K rows in interleaved RoPE pairs, the router's output multiplier
folded in, the residual gates' alpha/beta precomputed), no module of vLLM's. A
backbone adapter (the reference model, or vLLM's loaded modules) fills them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from . import nvfp4
from .reference import functional as fn
from .spec import ModelSpec

if TYPE_CHECKING:
    from .nvfp4_marlin import MarlinPerms

# How a rank holds its routed experts: a checkpoint's own layout (bf16, NVFP4) or
# vLLM's SM90 Marlin repack of NVFP4 experts (held in place, nvfp4_marlin.py).
CHECKPOINT_FORMATS = ("bf16", "nvfp4")
EXPERT_FORMATS = (*CHECKPOINT_FORMATS, "nvfp4_marlin")
NVFP4_FORMATS = ("nvfp4", "nvfp4_marlin")


@dataclass
class Nvfp4Scales:
    """The scales of NVFP4 experts (nvfp4.py), per rank."""

    w13_scale: torch.Tensor  # e4m3 [E_local, 2I_local, P / 16]
    w13_global: torch.Tensor  # fp32 [E_local, 2]: gate's, up's global decode scale
    w2_scale: torch.Tensor  # e4m3 [E_local, P, I_local / 16]
    w2_global: torch.Tensor  # fp32 [E_local]
    # The activation scales the checkpoint carries (unused by weight-only kernels).
    w13_input_scale: torch.Tensor | None = None  # fp32 [E_local, 2]
    w2_input_scale: torch.Tensor | None = None  # fp32 [E_local]


@dataclass
class Nvfp4MarlinScales:
    """The scales of NVFP4 experts as vLLM keeps them after its SM90 Marlin repack
    (nvfp4_marlin.py), per rank, and the permutations that read them back."""

    w13_scale: torch.Tensor  # one byte [E_local, P / 16, 2I_local]: Marlin's permuted S0E5M3 block scales
    w13_global: torch.Tensor  # fp32 [E_local]: the gate's global scale (both halves) * 2^119 / sf
    w2_scale: torch.Tensor  # one byte [E_local, I_local / 16, P]
    w2_global: torch.Tensor  # fp32 [E_local]: W2's global scale * up / gate * 2^119 / sf
    perms: MarlinPerms  # on the weights' device


@dataclass
class ExpertWeights:
    """The routed experts this rank holds.

    ``format`` names the storage: ``bf16`` (w13 bf16 [E_local, 2I_local, P], gate
    rows first; w2 bf16 [E_local, P, I_local]) or ``nvfp4`` (w13 uint8
    [E_local, 2I_local, P / 2], w2 uint8 [E_local, P, I_local / 2], two e2m1 codes a
    byte, with ``nvfp4`` scales) or ``nvfp4_marlin`` (vLLM's SM90 Marlin tiles: w13
    int32 [E_local, P / 16, 4I_local], w2 int32 [E_local, I_local / 16, 2P], eight
    codes a word, with ``marlin`` scales). Under EP a rank holds the whole experts
    ``first_expert .. first_expert + E_local - 1``; under expert TP every expert
    with an I-slice (``intermediate_slice``, this rank's rows of I).
    """

    format: str
    w13: torch.Tensor
    w2: torch.Tensor
    first_expert: int = 0
    intermediate_slice: tuple[int, int] | None = None
    nvfp4: Nvfp4Scales | None = None
    marlin: Nvfp4MarlinScales | None = None

    def __post_init__(self) -> None:
        if self.format not in EXPERT_FORMATS:
            raise ValueError(f"expert format {self.format!r} is not one of {EXPERT_FORMATS}")
        if (self.format == "nvfp4") != (self.nvfp4 is not None):
            raise ValueError("NVFP4 experts need their scales, and only they have them")
        if (self.format == "nvfp4_marlin") != (self.marlin is not None):
            raise ValueError("NVFP4 experts in Marlin's layout need Marlin's scales, and only they have them")

    @property
    def num_local(self) -> int:
        return self.w13.shape[0]

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """bf16 (w13, w2) of every expert held: the weights themselves for bf16;
        for NVFP4 a new dequantized copy (gate and up rows with their own global
        scales), as the reference computes with them; for Marlin's layout the weights
        Marlin computes with (nvfp4_marlin.dequantize)."""
        if self.marlin is not None:
            from . import nvfp4_marlin

            return nvfp4_marlin.dequantize(self)
        if self.nvfp4 is None:
            return self.w13, self.w2
        s = self.nvfp4
        gate, up = self.w13.chunk(2, dim=1)
        gate_scale, up_scale = s.w13_scale.chunk(2, dim=1)
        w13 = torch.cat(
            [
                nvfp4.dequantize(gate, gate_scale, s.w13_global[:, 0]),
                nvfp4.dequantize(up, up_scale, s.w13_global[:, 1]),
            ],
            dim=1,
        )
        return w13, nvfp4.dequantize(self.w2, s.w2_scale, s.w2_global)


def quantize_experts(experts: ExpertWeights, chunk: int = 16) -> ExpertWeights:
    """NVFP4 (ModelOpt's formula, nvfp4.quantize) of bf16 experts: gate, up and down
    each with its own global scale per expert, ``chunk`` experts at a time so no
    full-size fp32 temporary is made."""
    if experts.format != "bf16":
        raise ValueError(f"quantize_experts takes bf16 experts, got {experts.format}")
    num, rows13, width = experts.w13.shape
    inter = rows13 // 2
    dev = experts.w13.device
    w13 = torch.empty(num, rows13, width // 2, dtype=torch.uint8, device=dev)
    w13_scale = torch.empty(num, rows13, width // nvfp4.BLOCK, dtype=torch.float8_e4m3fn, device=dev)
    w13_global = torch.empty(num, 2, dtype=torch.float32, device=dev)
    w2 = torch.empty(num, width, experts.w2.shape[2] // 2, dtype=torch.uint8, device=dev)
    w2_scale = torch.empty(num, width, experts.w2.shape[2] // nvfp4.BLOCK, dtype=torch.float8_e4m3fn, device=dev)
    w2_global = torch.empty(num, dtype=torch.float32, device=dev)
    for start in range(0, num, chunk):
        part = slice(start, min(start + chunk, num))
        for half, rows in enumerate((slice(0, inter), slice(inter, rows13))):
            codes, scale, glob = nvfp4.quantize(experts.w13[part, rows])
            w13[part, rows], w13_scale[part, rows], w13_global[part, half] = codes, scale, glob
        w2[part], w2_scale[part], w2_global[part] = nvfp4.quantize(experts.w2[part])
    ones = torch.ones(num, 2, dtype=torch.float32, device=dev)
    scales = Nvfp4Scales(w13_scale, w13_global, w2_scale, w2_global, ones, ones[:, 0].clone())
    return ExpertWeights("nvfp4", w13, w2, experts.first_expert, experts.intermediate_slice, scales)


@dataclass
class LayerWeights:
    """One decoder layer's weights on one rank (shapes per rank)."""

    index: int
    window: int | None  # sliding window (keys a query sees), None on full layers
    rope_theta: float  # 0 on NoPE layers
    pre_qkv_norm: torch.Tensor  # bf16 [H], delta around 1
    qkvg: torch.Tensor  # bf16 [q + 2 kv + q, H]: [q | k | v | o-gate], Q/K rows in GPT-J pairs
    o_proj: torch.Tensor  # bf16 [H, q] (row-parallel: this rank's input columns)
    attn_gate: torch.Tensor  # bf16 [H], the raw post-attention residual gate
    attn_alpha: torch.Tensor  # fp32 [H]
    attn_beta: torch.Tensor  # fp32 [H]
    pre_ffn_norm: torch.Tensor  # bf16 [H]
    router: torch.Tensor  # fp32 [E, H], output multiplier folded in
    expert_bias: torch.Tensor  # fp32 [E], the selection bias
    pooler: torch.Tensor  # bf16 [P, H]
    pre_expert_norm: torch.Tensor  # bf16 [P]
    experts: ExpertWeights
    post_expert_norm: torch.Tensor  # bf16 [P]
    unpooler: torch.Tensor  # bf16 [H, P]
    post_ffn_norm: torch.Tensor  # bf16 [H]
    ffn_gate: torch.Tensor  # bf16 [H], the raw post-FFN residual gate
    ffn_alpha: torch.Tensor  # fp32 [H]
    ffn_beta: torch.Tensor  # fp32 [H]
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    # The router weight as the checkpoint stores it (before folding), kept only where
    # the weights are to be saved again.
    router_unfolded: torch.Tensor | None = None


@dataclass(frozen=True)
class Sharding:
    """How one rank's weights are cut from the model, as vLLM 0.33 cuts Muse Spark.

    Attention by head groups (this rank's [q | k | v | gate] rows), o_proj by input
    columns (partial sums), the router, norms and gates replicated; the routed
    experts as EP (``"ep"``: whole experts, E / tp a rank) or expert TP (``"tp"``: an
    I-slice of every expert); the pooler and unpooler replicated, or column-sharded
    (this rank's output columns, gathered by the consumer)."""

    tp: int = 1
    rank: int = 0
    expert_parallel: str = "ep"
    shard_pooler: bool = False
    shard_unpooler: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1 or not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} of TP {self.tp}")
        if self.expert_parallel not in ("ep", "tp"):
            raise ValueError(f"expert_parallel must be 'ep' or 'tp', got {self.expert_parallel!r}")

    def check(self, spec: ModelSpec) -> None:
        """Raise naming the first width that does not split over the ranks."""
        tp = self.tp
        for what, n in (
            ("num_attention_heads", spec.num_attention_heads),
            ("num_key_value_heads (vLLM does not pad KV heads for Muse Spark)", spec.num_key_value_heads),
            ("hidden_size", spec.hidden_size),
            ("moe_hidden_size", spec.moe_hidden_size),
            (
                "num_local_experts" if self.expert_parallel == "ep" else "moe_intermediate_size",
                spec.num_local_experts if self.expert_parallel == "ep" else spec.moe_intermediate_size,
            ),
        ):
            if n % tp:
                raise ValueError(f"TP {tp}: {what} = {n} does not split over {tp} ranks")

    def part(self, n: int) -> slice:
        """This rank's contiguous share of n."""
        size = n // self.tp
        return slice(self.rank * size, (self.rank + 1) * size)


@dataclass
class ModelWeights:
    """The backbone's weights on one rank: embedding, layers, final norm, LM head
    (the embedding and LM head replicated)."""

    spec: ModelSpec
    embed: torch.Tensor  # bf16 [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # bf16 [H], used as stored
    lm_head: torch.Tensor  # bf16 [V, H]
    sharding: Sharding = field(default_factory=Sharding)
    rope_tables: dict[float, torch.Tensor] = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return self.sharding.tp

    @property
    def rank(self) -> int:
        return self.sharding.rank

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def expert_format(self) -> str:
        """What ``Deployment.expert_format`` says of these weights: the quantized
        format of their routed experts (bf16 edge layers beside it), else bf16."""
        formats = {layer.experts.format for layer in self.layers} - {"bf16"}
        if len(formats) > 1:
            raise ValueError(f"the layers hold routed experts in several quantized formats: {sorted(formats)}")
        return formats.pop() if formats else "bf16"

    def rope_table(self, theta: float, max_positions: int) -> torch.Tensor:
        """The fp32 [cos | sin] table of ``theta``, built once and shared by every layer."""
        table = self.rope_tables.get(theta)
        if table is None or table.shape[0] < max_positions:
            table = fn.rope_table(theta, self.spec.head_dim, max_positions, self.device)
            self.rope_tables[theta] = table
        return table


def fold_router(router_unfolded: torch.Tensor, output_multiplier: float) -> torch.Tensor:
    """The router weight vLLM keeps: fp32 W * output_multiplier, rounded once in fp32."""
    return router_unfolded.float() * output_multiplier


def interleave_qk_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF stores Q/K rows as [even | odd] halves per head; vLLM re-orders them to
    interleaved (GPT-J) pairs at load, NoPE layers too."""
    rows, cols = weight.shape
    return weight.reshape(-1, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def deinterleave_qk_rows(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The inverse of ``interleave_qk_rows`` (vLLM order back to the HF order)."""
    rows, cols = weight.shape
    return weight.reshape(-1, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def make_layer(
    spec: ModelSpec,
    index: int,
    *,
    q_proj: torch.Tensor,
    k_proj: torch.Tensor,
    v_proj: torch.Tensor,
    gate_proj: torch.Tensor,
    tensors: dict[str, Any],
) -> LayerWeights:
    """A layer from checkpoint-form tensors (Q/K rows in the HF order, router
    unfolded, raw gates): re-orders, folds and precomputes as vLLM does at load.
    The tensors may be one rank's shard (head counts follow the q/k rows; the
    experts' ``first_expert`` and ``intermediate_slice`` ride along in ``tensors``).
    NVFP4 experts: ``w13`` / ``w2`` the packed codes and ``tensors["nvfp4"]`` their
    ``Nvfp4Scales``."""
    q = interleave_qk_rows(q_proj, spec.head_dim)
    k = interleave_qk_rows(k_proj, spec.head_dim)
    attn_alpha, attn_beta = fn.gate_coefficients(tensors["attn_gate"], spec.residual_gate_temperature)
    ffn_alpha, ffn_beta = fn.gate_coefficients(tensors["ffn_gate"], spec.residual_gate_temperature)
    router_unfolded = tensors["router"].float()
    return LayerWeights(
        index=index,
        window=spec.window(index),
        rope_theta=spec.layer_rope_theta[index],
        pre_qkv_norm=tensors["pre_qkv_norm"],
        qkvg=torch.cat([q, k, v_proj, gate_proj], dim=0).contiguous(),
        o_proj=tensors["o_proj"],
        attn_gate=tensors["attn_gate"],
        attn_alpha=attn_alpha,
        attn_beta=attn_beta,
        pre_ffn_norm=tensors["pre_ffn_norm"],
        router=fold_router(router_unfolded, spec.output_multiplier),
        expert_bias=tensors["expert_bias"].float(),
        pooler=tensors["pooler"],
        pre_expert_norm=tensors["pre_expert_norm"],
        experts=ExpertWeights(
            "bf16" if tensors.get("nvfp4") is None else "nvfp4",
            tensors["w13"],
            tensors["w2"],
            tensors.get("first_expert", 0),
            tensors.get("intermediate_slice"),
            tensors.get("nvfp4"),
        ),
        post_expert_norm=tensors["post_expert_norm"],
        unpooler=tensors["unpooler"],
        post_ffn_norm=tensors["post_ffn_norm"],
        ffn_gate=tensors["ffn_gate"],
        ffn_alpha=ffn_alpha,
        ffn_beta=ffn_beta,
        num_heads=q_proj.shape[0] // spec.head_dim,
        num_kv_heads=k_proj.shape[0] // spec.head_dim,
        router_unfolded=router_unfolded,
    )


def random_weights(
    spec: ModelSpec,
    seed: int = 0,
    device: torch.device | str = "cpu",
    keep_unfolded_router: bool = True,
    sharding: Sharding | None = None,
    expert_format: str = "bf16",
) -> ModelWeights:
    """Seeded random weights for any spec, scaled so the activations stay O(1)
    through any number of layers: projections N(0, 1/fan_in) (their inputs are
    RMS-normed), norm deltas and residual gates small around their centres, the
    selection bias small beside the sigmoid scores. Drawn on ``device`` (one seed,
    the same weights on every device of a kind), a slice at a time so the real
    widths need no full-size fp32 temporary.

    With a ``sharding`` of more than one rank, only that rank's shard is drawn (for
    benchmarks of one rank at the real widths): the replicated tensors are the same
    on every rank, the sharded ones are that rank's part of some full model. To
    shard one known full model, draw it at TP 1 and use ``shard_weights``.

    ``expert_format="nvfp4"``: the routed experts of every layer but the first and
    the last (the edge layers) quantized with ModelOpt's formula, as released."""
    if expert_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"expert format {expert_format!r} is not one of {CHECKPOINT_FORMATS}")
    sharding = sharding or Sharding()
    sharding.check(spec)
    dev = torch.device(device)
    shared = torch.Generator(device=dev).manual_seed(seed)
    local = (
        shared if sharding.tp == 1 else torch.Generator(device=dev).manual_seed(seed * 1_000_003 + sharding.rank + 1)
    )

    def normal(*shape: int, std: float, dtype: torch.dtype = fn.BF16, g: torch.Generator = shared) -> torch.Tensor:
        out = torch.empty(*shape, dtype=dtype, device=dev)
        for chunk in out.view(-1, *shape[-2:]) if len(shape) > 2 else (out,):
            chunk.copy_(torch.randn(chunk.shape, generator=g, device=dev) * std)
        return out

    def part(n: int) -> int:
        return n // sharding.tp

    H, P, I, E = spec.H, spec.P, spec.I, spec.E  # noqa: E741, N806
    ep = sharding.expert_parallel == "ep"
    e_rows, i_rows = (part(E), I) if ep else (E, part(I))
    layers = []
    for index in range(spec.num_layers):
        w13 = normal(e_rows, 2 * i_rows, P, std=P**-0.5, g=local)
        tensors = {
            "pre_qkv_norm": normal(H, std=0.1),
            "o_proj": normal(H, part(spec.q_size), std=spec.q_size**-0.5, g=local),
            "attn_gate": normal(H, std=0.5),
            "pre_ffn_norm": normal(H, std=0.1),
            "router": normal(E, H, std=H**-0.5, dtype=fn.FP32),
            "expert_bias": normal(E, std=0.02, dtype=fn.FP32),
            "pooler": normal(
                part(P) if sharding.shard_pooler else P, H, std=H**-0.5, g=local if sharding.shard_pooler else shared
            ),
            "pre_expert_norm": normal(P, std=0.1),
            "w13": w13,
            "w2": normal(e_rows, P, i_rows, std=I**-0.5, g=local),
            "post_expert_norm": normal(P, std=0.1),
            "unpooler": normal(
                part(H) if sharding.shard_unpooler else H,
                P,
                std=P**-0.5,
                g=local if sharding.shard_unpooler else shared,
            ),
            "post_ffn_norm": normal(H, std=0.1),
            "ffn_gate": normal(H, std=0.5),
            "first_expert": sharding.part(E).start if ep else 0,
            "intermediate_slice": None if ep or sharding.tp == 1 else (sharding.part(I).start, sharding.part(I).stop),
        }
        layer = make_layer(
            spec,
            index,
            q_proj=normal(part(spec.q_size), H, std=H**-0.5, g=local),
            k_proj=normal(part(spec.kv_size), H, std=H**-0.5, g=local),
            v_proj=normal(part(spec.kv_size), H, std=H**-0.5, g=local),
            gate_proj=normal(part(spec.q_size), H, std=H**-0.5, g=local),
            tensors=tensors,
        )
        if not keep_unfolded_router:
            layer.router_unfolded = None
        if expert_format == "nvfp4" and 0 < index < spec.num_layers - 1:
            layer.experts = quantize_experts(layer.experts)
        layers.append(layer)
    return ModelWeights(
        spec=spec,
        embed=normal(spec.vocab_size, H, std=1.0),
        layers=layers,
        final_norm=(1.0 + normal(H, std=0.1, dtype=fn.FP32)).to(fn.BF16),
        lm_head=normal(spec.vocab_size, H, std=H**-0.5),
        sharding=sharding,
    )


def shard_layer(spec: ModelSpec, layer: LayerWeights, sharding: Sharding) -> LayerWeights:
    """One rank's part of a TP-1 layer (copies of the sharded tensors; the
    replicated ones shared)."""

    q, kv = spec.q_size, spec.kv_size
    rows = layer.qkvg.split([q, kv, kv, q])
    qkvg = torch.cat([r[sharding.part(r.shape[0])] for r in rows]).contiguous()
    experts = _shard_experts(spec, layer.experts, sharding)
    return replace(
        layer,
        qkvg=qkvg,
        o_proj=layer.o_proj[:, sharding.part(q)].contiguous(),
        pooler=layer.pooler[sharding.part(spec.P)].contiguous() if sharding.shard_pooler else layer.pooler,
        unpooler=layer.unpooler[sharding.part(spec.H)].contiguous() if sharding.shard_unpooler else layer.unpooler,
        experts=experts,
        num_heads=spec.num_attention_heads // sharding.tp,
        num_kv_heads=spec.num_key_value_heads // sharding.tp,
    )


def _shard_experts(spec: ModelSpec, e: ExpertWeights, sharding: Sharding) -> ExpertWeights:
    """EP: this rank's whole experts. Expert TP: every expert's I-slice: W13's gate and
    up rows of the slice, W2's columns of it (packed NVFP4: its bytes and its scale
    blocks; the global scales stay per expert)."""
    if e.marlin is not None:
        raise ValueError("experts in Marlin's layout are one rank's already (vLLM cut them); shard the checkpoint's")
    q = e.nvfp4
    if sharding.expert_parallel == "ep":
        part = sharding.part(spec.E)
        scales = None
        if q is not None:
            scales = Nvfp4Scales(*(None if t is None else t[part].contiguous() for t in vars(q).values()))
        return ExpertWeights(e.format, e.w13[part].contiguous(), e.w2[part].contiguous(), part.start, None, scales)
    part = sharding.part(spec.I)
    if q is not None and (part.stop - part.start) % nvfp4.BLOCK:
        raise ValueError(
            f"expert TP {sharding.tp}: each rank's {part.stop - part.start} rows of I = {spec.I} must be whole "
            f"NVFP4 scale blocks of {nvfp4.BLOCK} (W2's scales cut along I)"
        )

    def rows13(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=1)
        return torch.cat([gate[:, part], up[:, part]], dim=1).contiguous()

    def cols(t: torch.Tensor, per: int) -> torch.Tensor:
        return t[:, :, part.start // per : part.stop // per].contiguous()

    scales = None
    if q is not None:
        scales = replace(q, w13_scale=rows13(q.w13_scale), w2_scale=cols(q.w2_scale, nvfp4.BLOCK))
    w2 = cols(e.w2, 2 if q is not None else 1)
    return ExpertWeights(e.format, rows13(e.w13), w2, 0, (part.start, part.stop), scales)


def shard_weights(weights: ModelWeights, sharding: Sharding) -> ModelWeights:
    """One rank's weights of a TP-1 model, cut as vLLM 0.33 cuts them (``Sharding``)."""
    if weights.tp != 1:
        raise ValueError("shard_weights takes TP-1 weights")
    sharding.check(weights.spec)
    return replace(
        weights,
        layers=[shard_layer(weights.spec, layer, sharding) for layer in weights.layers],
        sharding=sharding,
        rope_tables={},
    )
