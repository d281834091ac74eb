"""What every provider of this pack needs, read from the ``Deployment`` (the same
answer on every rank). FlashInfer is imported here only on a Hopper deployment
with the pinned release installed, to find an install that cannot import (one
without its own dependencies) before a build would."""

from __future__ import annotations

import torch

from sparkdecode.deployment import import_problem
from sparkdecode.protocols import BuildContext, Deployment, LayerKV

# The FlashInfer release whose kernels this pack was read against and tested with:
# the XQA mask and window semantics, the prefill plan, their JIT module names.
FLASHINFER_VERSION = "0.7.2"
FLASHINFER_PIN = "flashinfer-python==0.7.2.post1"


def flashinfer_unsupported(d: Deployment) -> str | None:
    """A Hopper GPU, FlashInfer 0.7.2 installed, bf16 K/V (the attention cores)."""
    reason = flashinfer_gpu_unsupported(d)
    if reason is None and d.kv_dtype != torch.bfloat16:
        reason = f"KV cache in {d.kv_dtype}; the attention cores read bf16 K/V"
    return reason


def flashinfer_gpu_unsupported(d: Deployment, module: str = "flashinfer") -> str | None:
    """A Hopper GPU and FlashInfer 0.7.2 installed (every provider of the pack), its
    ``module`` importable."""
    if d.device != "cuda" or d.capability is None:
        return "needs a CUDA GPU"
    if d.capability[0] != 9:
        major, minor = d.capability
        return f"built and tested for SM90 (Hopper); this GPU is SM{major}{minor}"
    version = d.libraries.get("flashinfer")
    if version is None:
        return f"FlashInfer is not installed (pip install {FLASHINFER_PIN})"
    if version != FLASHINFER_VERSION and not version.startswith((f"{FLASHINFER_VERSION}.", f"{FLASHINFER_VERSION}+")):
        return f"FlashInfer {version} is installed; this pack is built against {FLASHINFER_PIN}"
    return import_problem(module)


def check_cache(
    name: str, layer: int, kv: LayerKV, kv_heads: int, head_dim: int, page_size: int, window: int | None
) -> None:
    """Raise unless ``kv`` is the cache form both kernels take: bf16 K/V views
    [pages, page_size, Hkv, d] (NHD) with contiguous rows and the same strides, of a
    layer with the provider's ``window``."""
    if kv.window != window:
        raise ValueError(f"{name}, layer {layer}: cache window {kv.window}, layer {window}")
    for label, t in (("K", kv.k), ("V", kv.v)):
        if t.dtype != torch.bfloat16 or t.dim() != 4 or tuple(t.shape[1:]) != (page_size, kv_heads, head_dim):
            raise ValueError(
                f"{name}, layer {layer}: {label} cache {tuple(t.shape)} {t.dtype} is not bf16 "
                f"[pages, {page_size}, {kv_heads}, {head_dim}]"
            )
        if t.stride(3) != 1 or any(s % head_dim for s in t.stride()[:3]):
            raise ValueError(f"{name}, layer {layer}: {label} cache strides {t.stride()} are not whole rows")
    if kv.k.stride() != kv.v.stride():
        raise ValueError(f"{name}, layer {layer}: K and V caches have different strides")


def contiguous_rows(ctx: BuildContext, name: str, heads: int) -> torch.Tensor:
    """A bf16 [max_rows, heads, d] staging buffer for a q or an output that is not
    contiguous (the kernels take packed rows)."""
    return ctx.scratch(name, (ctx.max_rows, heads, ctx.spec.head_dim), torch.bfloat16)
