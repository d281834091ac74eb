"""One function per formula of Muse Spark's decode step (MUSE_SPARK.md).

The reference model (the stock forward) and the reference providers both call
these, so the two agree bit for bit. Every function states its dtypes and where
it rounds: those rounding points are vLLM 0.33's stock forward's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BF16 = torch.bfloat16
FP32 = torch.float32


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``x * rsqrt(mean(x^2) + eps)`` over the last dim (x already fp32)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def pre_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``rms(x) * (1 + w)``: pre_qkv_proj_norm, pre_ffn_norm, pre_expert_norm.
    The checkpoint stores w as a delta around 1."""
    return rms(x.float(), eps) * (weight.float() + 1.0)


def final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``rms(x) * w``: model.norm (its weight used as stored)."""
    return rms(x.float(), eps) * weight.float()


def input_scale_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``rms(x * (1 + w))``: post_ffn_norm and post_expert_norm (the gain
    multiplies before normalizing)."""
    return rms(x.float() * (weight.float() + 1.0), eps)


def weightless_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``rms(x)``: embedding norm, post_attn_norm, QK norm, o-norm."""
    return rms(x.float(), eps)


def gate_coefficients(gate: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 (alpha, beta) of a residual gate: u = g / T, beta = sigmoid(u),
    alpha = sqrt(max(sigmoid(-u) * (1 + beta), 1e-3)). vLLM precomputes these at load."""
    u = gate.float() / temperature
    beta = torch.sigmoid(u)
    alpha = torch.sqrt(torch.clamp(torch.sigmoid(-u) * (1.0 + beta), min=1e-3))
    return alpha.contiguous(), beta.contiguous()


def gated_add(stream: torch.Tensor, branch: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """fp32 ``alpha * s + beta * b`` (b already post-normed, kept in fp32)."""
    return alpha * stream + beta * branch


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` in the weight's dtype: bf16 GEMMs round their output to bf16
    (fp32 accumulation), the fp32 router GEMM stays fp32."""
    return F.linear(x.to(weight.dtype), weight)


def embed_norm(rows: torch.Tensor, eps: float) -> torch.Tensor:
    """The fp32 stream of the embedded tokens: ``rms(embed[token])``."""
    return weightless_norm(rows, eps)


def qk_norm(x: torch.Tensor, head_dim: int, eps: float) -> torch.Tensor:
    """Weightless per-head RMS norm, rounded to bf16 (before RoPE). [b, n*d] -> [b, n, d]."""
    b = x.shape[0]
    return weightless_norm(x.reshape(b, -1, head_dim), eps).to(BF16)


def rope_table(theta: float, head_dim: int, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """fp32 [max_positions, head_dim] = [cos | sin], as vLLM's RotaryEmbedding builds it
    (inverse frequencies on the CPU in fp32, then t x inv_freq)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=FP32) / head_dim))
    t = torch.arange(max_positions, dtype=FP32)
    freqs = torch.outer(t, inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)


def rope_gptj(x: torch.Tensor, positions: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE (interleaved pairs (2i, 2i+1)) of bf16 [b, n, d] at ``positions``:
    computed in fp32 from the bf16 input and the fp32 table, rounded once to bf16."""
    half = x.shape[-1] // 2
    cos_sin = table.index_select(0, positions)
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]
    x32 = x.float()
    even, odd = x32[..., 0::2], x32[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return out.flatten(-2).to(BF16)


def key_positions(positions: torch.Tensor, window: int | None, max_context: int, rows: int) -> torch.Tensor:
    """int64 key positions an attention over ``rows`` queries reads, fixed in size so
    the gather replays in a graph: the window before the first query on sliding
    layers (window + rows - 1 keys), every position below ``max_context`` on full ones.
    Some may be negative or past the last query: the mask drops them."""
    if window is None:
        return torch.arange(max_context, device=positions.device)
    first = positions[:1]
    return first - (window - 1) + torch.arange(window + rows - 1, device=positions.device)


def paged_attention(
    q: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    window: int | None,
    scale: float,
    max_context: int,
) -> torch.Tensor:
    """Causal attention of bf16 q [b, Hq, d] at ``positions`` over the paged cache
    (k/v [blocks, block_size, Hkv, d], any strides; block_table int32 [max_blocks]).
    A query at p sees keys p - window + 1 .. p (all keys <= p on full layers).
    Scores and softmax in fp32 from bf16 operands, output rounded to bf16 [b, Hq, d].
    Keys outside every query's range are zeroed before use: a released page may hold
    anything, NaN included."""
    b, num_heads, d = q.shape
    block_size, num_kv = k_cache.shape[1], k_cache.shape[2]
    kpos = key_positions(positions, window, max_context, b)
    page = torch.clamp(kpos, min=0) // block_size
    page = torch.clamp(page, max=block_table.shape[0] - 1)
    blocks = block_table.index_select(0, page).long()
    offset = torch.clamp(kpos, min=0) % block_size
    keys = k_cache[blocks, offset].float()  # [n, Hkv, d]
    values = v_cache[blocks, offset].float()
    valid = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] >= 0)
    if window is not None:
        valid &= kpos[None, :] > positions[:, None] - window
    used = valid.any(dim=0)
    keys = torch.where(used[:, None, None], keys, 0.0)
    values = torch.where(used[:, None, None], values, 0.0)
    group = num_heads // num_kv
    qg = q.float().reshape(b, num_kv, group, d)
    scores = torch.einsum("bkgd,nkd->bkgn", qg, keys) * scale
    scores = torch.where(valid[:, None, None, :], scores, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgn,nkd->bkgd", probs, values)
    return out.reshape(b, num_heads, d).to(BF16)


def kv_insert(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Write bf16 k, v [b, Hkv, d] into the paged cache at ``slot_mapping`` (int64 [b]).
    A row with a negative slot (vLLM's PAD_SLOT_ID, a padding row) writes nothing, as
    vLLM's insert skips it. Capturable: such a row writes slot 0 its own value back
    (slot 0 lies in vLLM's null block, which no request's row is mapped to)."""
    block_size = k_cache.shape[1]
    valid = (slot_mapping >= 0)[:, None, None]
    slots = slot_mapping.clamp(min=0)
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offset = slots % block_size
    k_cache[blocks, offset] = torch.where(valid, k, k_cache[blocks, offset])
    v_cache[blocks, offset] = torch.where(valid, v, v_cache[blocks, offset])


def o_norm_gate(o: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16 ``rms_per_head(o) * sigmoid(g)`` in fp32, rounded once. o [b, n, d], gate [b, n*d]."""
    g = gate.reshape(o.shape).float()
    return (weightless_norm(o, eps) * torch.sigmoid(g)).to(BF16)


def route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, scaling: float, eps: float = 1e-15
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing of fp32 router logits [b, E] (output multiplier already folded):
    p = sigmoid(z); the top-k of p + bias, ties to the lowest expert index; weights
    p[idx] * (scaling / (sum + eps)), the sum taken in selection order as the stock
    kernel takes it. Returns (int32 ids [b, k], fp32 weights [b, k])."""
    p = torch.sigmoid(logits)
    # A stable descending sort keeps equal scores in index order: ties go low.
    order = torch.sort(p + bias, dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    chosen = p.gather(1, ids)
    total = torch.zeros_like(chosen[:, 0])
    for j in range(top_k):
        total = total + chosen[:, j]
    weights = chosen * (scaling / (total + eps))[:, None]
    return ids.to(torch.int32), weights


def swiglu(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """bf16 ``silu(gate) * up`` computed in fp32 from the bf16 GEMM1 output [n, 2I]."""
    gate, up = gate_up[:, :intermediate].float(), gate_up[:, intermediate:].float()
    return (F.silu(gate) * up).to(BF16)


def expert_rows(
    h: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, first_expert: int = 0
) -> torch.Tensor:
    """Routed expert rows of bf16 h [b, P] for int32 ids [b, k] (global expert ids):
    y[r, j] = (silu(gate) * up) @ W2[e]^T with [gate | up] = h[r] @ W13[e]^T,
    W13 [E_local, 2I, P] (gate rows first), W2 [E_local, P, I], both GEMMs rounded to
    bf16. Experts this rank does not hold (EP) give zero rows. Returns bf16 [b, k, P].

    The routes are sorted by expert and run as two grouped GEMMs (each selected
    expert's weights read once), with the group offsets on the device: no host
    sync, so it captures in a CUDA graph."""
    b, k = ids.shape
    num_local, intermediate = w13.shape[0], w2.shape[2]
    local = ids.reshape(-1).long() - first_expert
    held = (local >= 0) & (local < num_local)
    key = torch.where(held, local, num_local)  # routes to other ranks' experts sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=h.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    offsets = torch.cumsum(counts[:num_local], 0).to(torch.int32)
    x = h.index_select(0, order // k)
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offsets)
    y = torch._grouped_mm(swiglu(gate_up, intermediate), w2.transpose(1, 2), offs=offsets)
    # Rows past the last group (other ranks' experts) are left unwritten: zero them.
    y = torch.where(held.index_select(0, order)[:, None], y, 0)
    rows = torch.empty_like(y)
    rows.index_copy_(0, order, y)
    return rows.reshape(b, k, -1)


def moe_tail(rows: torch.Tensor, weights: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
    """bf16 ``sum_j w[r, j] * post_expert_norm(y[r, j])`` of rows bf16 [b, k, P] and fp32
    weights [b, k]; each route normed in fp32, summed in fp32 in slot order."""
    contrib = input_scale_norm(rows, norm, eps) * weights[..., None]
    total = contrib[:, 0]
    for j in range(1, contrib.shape[1]):
        total = total + contrib[:, j]
    return total.to(BF16)


def softcap_logits(logits: torch.Tensor, multiplier: float, cap: float) -> torch.Tensor:
    """fp32 ``cap * tanh(multiplier * logits / cap)`` of the bf16 LM-head output."""
    return cap * torch.tanh(logits.float() * multiplier / cap)
