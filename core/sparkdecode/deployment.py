"""The deployment gate: whether the specialized decode can serve a deployment.

``decode_backend`` is ``auto`` (the stock decode) or ``latency_specialized``;
anything else raises. When the specialized decode is requested, every unmet
requirement raises at start-up with a sentence naming it, and the ranks agree
(a MIN all-reduce) before anyone proceeds, so one rank's missing library stops
every rank with that rank's reason. The same gate serves ``sparkdecode check``;
the vLLM integration adds the serving configuration's own lines in front.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from .layout import LayoutError, resolve
from .plugins import Registry, discover
from .protocols import Deployment
from .spec import ModelSpec
from .weights import EXPERT_FORMATS

T = TypeVar("T")
BACKENDS = ("auto", "latency_specialized")
TP_SIZES = (1, 2, 4, 8)
# Importable name -> distribution, for what providers may require.
LIBRARIES = {
    "torch": "torch",
    "pluggy": "pluggy",
    "flashinfer": "flashinfer-python",
    "cutlass": "nvidia-cutlass-dsl",
    "cuda.bindings": "cuda-bindings",
    "vllm": "vllm",
}


class DeploymentError(ValueError):
    """The specialized decode was requested for a deployment it cannot serve."""


def decode_backend(additional_config: Mapping[str, Any] | None) -> str:
    """The requested ``decode_backend``: ``auto`` when unset; anything else raises."""
    value = (additional_config or {}).get("decode_backend", "auto")
    if value not in BACKENDS:
        raise DeploymentError(f"decode_backend must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def installed_libraries() -> dict[str, str | None]:
    """Importable name -> installed version (None when missing), without importing:
    a distribution whose module is not there (``pip install --no-deps
    nvidia-cutlass-dsl`` leaves its placeholder without ``cutlass``) counts as missing."""
    out: dict[str, str | None] = {}
    for module, dist in LIBRARIES.items():
        try:
            version: str | None = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = None
        try:
            present = importlib.util.find_spec(module) is not None
        except Exception:  # a parent package missing or broken (find_spec imports it)
            present = False
        out[module] = version if present else None
    return out


@functools.cache
def import_problem(module: str) -> str | None:
    """Why ``module`` fails to import here (a library installed without what it needs),
    or None. Imports it: for a provider's ``unsupported`` once the cheap checks have
    passed, so the failure is a reason, not a traceback from its build."""
    try:
        importlib.import_module(module)
    except Exception as e:
        text = " ".join(str(e).split())
        return f"{module} is installed but cannot be imported ({type(e).__name__}: {text})"
    return None


def detect(
    spec: ModelSpec,
    tp: int = 1,
    device: torch.device | str | None = None,
    *,
    max_rows: int = 8,
    max_context: int = 4096,
    expert_format: str = "bf16",
    expert_parallel: str = "ep",
    shard_pooler: bool = False,
    shard_unpooler: bool = False,
) -> Deployment:
    """The deployment of this process: its device (CUDA when there is one), the
    GPU's capability and name, and the installed libraries."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    capability = name = None
    if dev.type == "cuda":
        capability = torch.cuda.get_device_capability(dev)
        name = torch.cuda.get_device_name(dev)
    return Deployment(
        spec=spec,
        tp=tp,
        device=dev.type,
        capability=capability,
        gpu_name=name,
        expert_format=expert_format,
        max_rows=max_rows,
        max_context=max_context,
        expert_parallel=expert_parallel,
        shard_pooler=shard_pooler,
        shard_unpooler=shard_unpooler,
        libraries=installed_libraries(),
    )


def requirements(d: Deployment) -> list[str]:
    """Every unmet requirement of the executor itself (providers add their own)."""
    s, out = d.spec, []
    if d.tp not in TP_SIZES:
        out.append(f"tensor parallel size {d.tp} (supported: {', '.join(map(str, TP_SIZES))})")
    elif s.num_attention_heads % d.tp or s.num_key_value_heads % d.tp:
        # vLLM's fused QKV+gate projection does not pad or replicate KV heads.
        out.append(
            f"tensor parallel size {d.tp}: {s.num_attention_heads} query / {s.num_key_value_heads} KV heads do not split evenly"
        )
    elif (d.shard_pooler and s.moe_hidden_size % d.tp) or (d.shard_unpooler and s.hidden_size % d.tp):
        out.append(f"tensor parallel size {d.tp}: the sharded pooler/unpooler columns do not split evenly")
    if d.expert_parallel not in ("ep", "tp"):
        out.append(f"expert parallelism {d.expert_parallel!r} (supported: 'ep', 'tp')")
    elif d.tp in TP_SIZES:  # the experts' split is judged at a supported size only
        if d.expert_parallel == "ep" and s.num_local_experts % d.tp:
            out.append(f"expert parallel over {d.tp} ranks: {s.num_local_experts} experts do not split evenly")
        elif d.expert_parallel == "tp" and s.moe_intermediate_size % d.tp:
            out.append(
                f"expert TP over {d.tp} ranks: moe_intermediate_size {s.moe_intermediate_size} does not split evenly"
            )
    if d.expert_format not in EXPERT_FORMATS:
        out.append(f"expert format {d.expert_format!r} (supported: {', '.join(EXPERT_FORMATS)})")
    if d.kv_dtype != torch.bfloat16:
        out.append(f"KV cache dtype {d.kv_dtype} (bf16 only)")
    if d.kv_block_size != 16:
        out.append(f"KV cache block size {d.kv_block_size} (16 only)")
    if d.max_rows < 1:
        out.append(f"prepared rows {d.max_rows} (at least 1)")
    if d.max_context < 1:
        out.append(f"max context {d.max_context} (at least 1)")
    if d.max_context > s.max_position_embeddings:
        out.append(f"max context {d.max_context} above the model's {s.max_position_embeddings} positions")
    return out


def unsupported(d: Deployment, registry: Registry | None = None, pins: Mapping[str, str] | None = None) -> str | None:
    """The first reason this deployment cannot run the specialized decode, or None:
    the executor's own requirements, then the layout's (a block no provider
    supports, or a pin that cannot be honoured)."""
    reasons = requirements(d)
    if reasons:
        return reasons[0]
    try:
        resolve(registry if registry is not None else discover(), d, pins)
    except LayoutError as e:
        return str(e)
    return None


def agree(reason: str | None, group: Any = None) -> str | None:
    """Every rank's verdict combined: None if every rank is fine, else the first
    failing rank's reason (collective over ``group``: a MIN all-reduce of "ok", then
    the reasons gathered only when some rank failed)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return reason
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    ok = torch.tensor([0 if reason else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if int(ok.item()) == 1:
        return None
    reasons: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(reasons, reason, group=group)
    rank, first = next((r, x) for r, x in enumerate(reasons) if x)
    return f"rank {rank}: {first}"


class RankFailedError(RuntimeError):
    """Raised on the ranks that did not fail when another rank's step did."""


def on_every_rank(step: Callable[[], T], group: Any, what: str) -> T:
    """``step()`` on this rank, with its failure made every rank's: this rank raises
    its own exception, the others a ``RankFailedError`` naming the first failing rank's
    (collective over ``group``; every rank must call it at the same point). For local
    work before or between collectives (a build, an allocation, a compile): one rank
    failing there would otherwise leave the others waiting in the next collective."""
    problem: Exception | None = None
    value: Any = None
    try:
        value = step()
    except Exception as e:
        problem = e
    reason = agree(None if problem is None else f"{type(problem).__name__}: {problem}", group)
    if problem is not None:
        raise problem
    if reason is not None:
        raise RankFailedError(f"{what} failed on {reason}")
    return value


def require(
    d: Deployment, registry: Registry | None = None, pins: Mapping[str, str] | None = None, group: Any = None
) -> None:
    """Raise ``DeploymentError`` on every rank if any rank cannot serve ``d``."""
    reason = agree(unsupported(d, registry, pins), group)
    if reason is not None:
        raise DeploymentError(f"the specialized decode does not support this deployment: {reason}")
