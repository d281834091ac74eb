"""The memory floor of one step: the bytes it must read, and the copy bandwidth
they are divided by.

Bytes per block (this rank's tensors, as stored):

- ``embed``: the step's rows of the embedding table;
- ``boundary(l)``: the previous layer's post_ffn_norm and FFN gate coefficients
  (alpha, beta) (layer 0 has none), this layer's pre_qkv_proj_norm;
- ``attention(l)``: the QKV+gate and o_proj weights, and the K and V the step's
  queries see: on sliding layers the union of their windows (window + rows - 1
  keys), on full layers the whole context;
- ``attention_boundary(l)``: the attention gate coefficients, pre_ffn_norm;
- ``moe(l)``: router (fp32), selection bias, pooler, pre/post expert norms,
  unpooler, and each DISTINCT routed expert once (w13 and w2 of this rank; NVFP4:
  codes, e4m3 scales and the fp32 global scales the dequantization reads);
- ``final``: the last post_ffn_norm and gate coefficients, model.norm.

Activations, the K/V the step writes and the LM head (outside the step) are not
counted. The floor is bytes / the copy bandwidth measured in the same run (a
large device-to-device copy; bytes read + written, as a copy's bandwidth is quoted).
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import torch

from ..weights import ExpertWeights, LayerWeights, ModelWeights


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_bytes(layer: LayerWeights) -> int:
    """One routed expert's weights on this rank (w13 and w2 rows of one expert; for
    NVFP4, in the checkpoint's layout or Marlin's, with its block scales and global
    scales; the activation input scales, which a weight-only kernel does not read,
    are not counted)."""
    e = layer.experts
    total = nbytes(e.w13[0], e.w2[0])
    q = e.nvfp4 or e.marlin
    if q is not None:
        total += nbytes(q.w13_scale[0], q.w13_global[0], q.w2_scale[0], q.w2_global[0])
    return total


def expert_tensors(e: ExpertWeights) -> list[torch.Tensor]:
    """Every tensor of a layer's routed experts as stored (NVFP4 with all its scales;
    Marlin's layout with its scales and globals, not the shared permutations)."""
    out = [e.w13, e.w2]
    if e.nvfp4 is not None:
        out += [t for t in vars(e.nvfp4).values() if t is not None]
    if e.marlin is not None:
        m = e.marlin
        out += [m.w13_scale, m.w13_global, m.w2_scale, m.w2_global]
    return out


def kv_keys(layer: LayerWeights, context: int, rows: int) -> int:
    """Keys the step's queries see on this layer (its last query at ``context - 1``)."""
    if layer.window is None:
        return context
    return min(context, layer.window + rows - 1)


def kv_bytes(layer: LayerWeights, context: int, rows: int, head_dim: int, element_size: int = 2) -> int:
    """K and V bytes of ``kv_keys`` keys on this rank's KV heads."""
    return 2 * kv_keys(layer, context, rows) * layer.num_kv_heads * head_dim * element_size


class BlockBytes(NamedTuple):
    name: str  # "attention.3", "final", ...
    kind: str  # the block kind, with the attention split into sliding and full
    layer: int | None
    bytes: int


def block_bytes(weights: ModelWeights, context: int, rows: int, distinct: list[int]) -> list[BlockBytes]:
    """Every block's bytes in step order; ``distinct[l]`` is layer l's count of
    distinct routed experts in this step (read back from a run)."""
    spec, layers = weights.spec, weights.layers
    out = [BlockBytes("embed", "embed", None, rows * spec.H * weights.embed.element_size())]
    for i, layer in enumerate(layers):
        prev = layers[i - 1] if i else None
        boundary = nbytes(layer.pre_qkv_norm)
        if prev is not None:
            boundary += nbytes(prev.post_ffn_norm, prev.ffn_alpha, prev.ffn_beta)
        attention = nbytes(layer.qkvg, layer.o_proj) + kv_bytes(layer, context, rows, spec.head_dim)
        moe = nbytes(
            layer.router,
            layer.expert_bias,
            layer.pooler,
            layer.pre_expert_norm,
            layer.post_expert_norm,
            layer.unpooler,
        )
        moe += distinct[i] * expert_bytes(layer)
        kind = "attention (sliding)" if layer.window is not None else "attention (full)"
        out += [
            BlockBytes(f"boundary.{i}", "boundary", i, boundary),
            BlockBytes(f"attention.{i}", kind, i, attention),
            BlockBytes(
                f"attention_boundary.{i}",
                "attention_boundary",
                i,
                nbytes(layer.attn_alpha, layer.attn_beta, layer.pre_ffn_norm),
            ),
            BlockBytes(f"moe.{i}", "moe", i, moe),
        ]
    last = layers[-1]
    out.append(
        BlockBytes(
            "final", "final", None, nbytes(last.post_ffn_norm, last.ffn_alpha, last.ffn_beta, weights.final_norm)
        )
    )
    return out


class CopyBandwidth(NamedTuple):
    bytes_moved: int  # read + written per copy
    median_s: float
    bytes_per_s: float
    copies: int


def copy_bandwidth(device: torch.device, size: int | None = None, reps: int = 20) -> CopyBandwidth:
    """A large device-to-device copy (1 GiB on a GPU, 64 MiB on the CPU), the
    median of ``reps`` copies; bytes read + written per second."""
    size = size or ((1 << 30) if device.type == "cuda" else (64 << 20))
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            dst.copy_(src)
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    del src, dst
    return CopyBandwidth(2 * size, median, 2 * size / median, reps)
