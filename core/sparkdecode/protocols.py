"""The contracts between the executor and the providers of its blocks.

One decode step of b rows (one request verifying q = b tokens):

    embed -> boundary (layer 0: the front) -> for each layer: attention ->
    attention_boundary -> moe -> next layer's boundary ... -> final

Each block is implemented by a provider class registered through the plug-in
hooks (plugins.py) and chosen by the layout resolver (layout.py). Sub-ops that a
block provider may take from elsewhere (``experts``, ``attention_core``,
``all_reduce``, ``linear``) are resolved the same way and handed over in ``BuildContext.ops``.

Shapes are per rank: b <= ``BuildContext.max_rows``; H hidden, P pooled width,
E experts, k top-k (spec.py). Lifecycle of every provider:

- ``unsupported(deployment)`` (class method) reads only the ``Deployment``: the
  same answer on every rank;
- ``build(ctx, layer)`` once, after the weights are loaded, before KV binding and
  graph capture: weight views, repacks, compiles, rendezvous, warm-ups, in the same
  order on every rank (builds may be collective);
- ``collective_setup(ctx)`` (optional class method) the build's collective steps
  (a workspace shared over the ranks), run by the executor before any build, in one
  order on every rank; a build then finds what it made in ``ctx`` and is this
  rank's own work (the executor agrees its failures over the ranks);
- ``prepare_kv(kv)`` for every bound KV cache;
- ``prepare_step(host)`` (optional) host work redone before every step, outside
  the graph; prefer kernels that need none. A provider that plans from the host's
  lengths refuses deployments whose ``host_lengths_exact`` is False;
- ``run(...)`` CUDA-graph capturable: allocates nothing, syncs nothing with the
  host, takes no per-step constant. Launches on the current stream; a provider
  that forks a side stream joins it before ``run`` returns.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from .spec import ModelSpec
    from .weights import LayerWeights, ModelWeights

BLOCKS = ("boundary", "attention", "attention_boundary", "moe", "final")
SUB_OPS = ("experts", "experts_nvfp4", "attention_core", "all_reduce", "linear")
# The dense weights a ``linear`` sub-op serves (LayerWeights attribute names).
LINEAR_WEIGHTS = ("qkvg", "o_proj", "router", "pooler", "unpooler")
KINDS = BLOCKS + SUB_OPS
# The DSpark draft's blocks (draft/protocols.py): a second layout over the same
# registry, resolved by the draft executor alone (the target needs none of them).
DRAFT_KINDS = (
    "draft_context",
    "draft_boundary",
    "draft_attention",
    "draft_attention_boundary",
    "draft_mlp",
    "draft_final",
    "markov",
)
ALL_KINDS = KINDS + DRAFT_KINDS


class KVGroupMetadata(NamedTuple):
    """One KV-cache group's metadata for the step, in device buffers whose contents
    change between graph replays (their shapes never do)."""

    block_table: torch.Tensor  # int32 [1, max_pages]: the request's pages, the null page where released
    seq_lens: torch.Tensor  # int32 [1]: context length after this step (last position + 1)
    slot_mapping: torch.Tensor  # int64 [max_rows]: each row's cache slot (page * block_size + offset)


class LayerKV(NamedTuple):
    """One layer's paged cache: strided K/V views and its group's metadata."""

    k: torch.Tensor  # bf16 [pages, block_size, Hkv, d], any strides
    v: torch.Tensor  # bf16 [pages, block_size, Hkv, d], any strides
    group: KVGroupMetadata
    window: int | None  # keys a query sees (counting itself) on sliding layers, None on full


class HostStep(NamedTuple):
    """The host's view of one step, for ``prepare_step`` (plain ints, no tensors)."""

    first_position: int
    rows: int
    context_len: int


def host_work(block: object, op: object) -> None:
    """Passes a sub-op's host work on as the block's own ``prepare_step`` (an
    attention block around a core planned on the host). A block whose sub-ops have
    none has no ``prepare_step``, so whether a step needs exact host values
    (``plans_on_host``) is read off the built providers."""
    hook = getattr(op, "prepare_step", None)
    if hook is not None:
        block.prepare_step = hook  # type: ignore[attr-defined]


def plans_on_host(providers: Iterable[object]) -> bool:
    """Whether any of these built providers does host work before each step."""
    return any(getattr(p, "prepare_step", None) is not None for p in providers)


class Step(NamedTuple):
    """A planned step: decided from host state, identical on every rank, holding
    device buffers whose contents change between replays."""

    q: int  # tokens per request
    rows: int  # b, the rows of this step (one request: b == q)
    positions: torch.Tensor  # int64 [b]
    kv: tuple[LayerKV, ...]  # per layer
    # The executor's embeddings buffer holds bf16 rows of the embedding table (False)
    # or the bf16 normed embeddings the multimodal path passes (True).
    normed_embeddings: bool


class RoutedTopk(NamedTuple):
    """The routing of b rows: global expert ids and their renormalized, scaled weights."""

    ids: torch.Tensor  # int32 [b, k]
    weights: torch.Tensor  # fp32 [b, k]
    # True when both were complete before the experts' first kernel launches (the routing
    # behind a full dependency, not a programmatic one: cuda.moe's side stream and its
    # join), so that kernel may read them before its PDL wait. False promises nothing.
    final: bool = False


class ExpertsInput(NamedTuple):
    """What the routed experts read: the pooled, pre-expert-normed rows."""

    x: torch.Tensor  # bf16 [b, P]
    # Block scales when the experts take a quantized input (NVFP4), else None.
    scale: torch.Tensor | None = None


@dataclass(frozen=True)
class Deployment:
    """What a provider's ``unsupported`` may read: the same on every rank.

    ``device`` is ``cpu`` or ``cuda``; ``capability`` the GPU's (major, minor) or None.
    ``libraries`` maps an importable library to its version (None if missing).
    """

    spec: ModelSpec
    tp: int = 1
    device: str = "cpu"
    capability: tuple[int, int] | None = None
    gpu_name: str | None = None
    expert_format: str = "bf16"
    kv_dtype: torch.dtype = torch.bfloat16
    kv_block_size: int = 16
    max_rows: int = 8
    max_context: int = 4096
    # "ep" (whole experts per rank) or "tp" (an I-slice of every expert).
    expert_parallel: str = "ep"
    shard_pooler: bool = False  # the pooler's output columns split over the ranks
    shard_unpooler: bool = False  # the unpooler's output columns split over the ranks
    libraries: dict[str, str | None] = field(default_factory=dict)
    # Whether the host knows each step's lengths exactly before the step (False under
    # vLLM's asynchronous scheduling, whose host count of computed tokens assumes every
    # draft accepted, unless the integration reads them off the device before each
    # step: ``decode_lengths: sync``): a provider that plans a step on the host
    # (``prepare_step``) from them needs True.
    host_lengths_exact: bool = True


class Mailbox(Protocol):
    """Where a producer publishes its column block of a [b, H] result for the next
    boundary to gather, with no separate collective kernel.

    ``publish(b)`` is this rank's destination view (bf16 [b, H / tp] for a
    column-sharded producer, [b, H] for a replicated one); ``gather(b)`` returns the
    whole bf16 [b, H] once every rank has published (blocks in rank order). Both are
    capturable; ``gather`` may be where a reference transport runs its collective.
    A reader with a device transport of its own (a column-sharded mailbox:
    ``publish(b)`` narrower than H) may instead read this rank's block from
    ``publish(b)`` and exchange the blocks itself, fused into its kernel.
    """

    def publish(self, b: int) -> torch.Tensor: ...

    def gather(self, b: int) -> torch.Tensor: ...


def check_kv_form(where: str, kv: LayerKV, kv_heads: int, head_dim: int) -> None:
    """Raise unless ``kv``'s K and V are bf16 [pages, block_size, kv_heads, head_dim]
    views (any strides); ``where`` names the layer in the message."""
    for name, t in (("K", kv.k), ("V", kv.v)):
        if t.dtype != torch.bfloat16 or t.dim() != 4 or tuple(t.shape[2:]) != (kv_heads, head_dim):
            raise ValueError(
                f"{where}: {name} cache {tuple(t.shape)} {t.dtype} is not bf16 "
                f"[pages, block_size, {kv_heads}, {head_dim}]"
            )


def scratch_buffer(
    buffers: dict[str, torch.Tensor], device: torch.device, name: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """``buffers[name]``, allocated on ``device`` at the first ask; a later ask for
    another shape or dtype is an error naming both."""
    buffer = buffers.get(name)
    if buffer is None:
        buffer = torch.empty(shape, dtype=dtype, device=device)
        buffers[name] = buffer
    if tuple(buffer.shape) != tuple(shape) or buffer.dtype != dtype:
        raise ValueError(f"buffer {name!r} is {tuple(buffer.shape)} {buffer.dtype}, asked for {shape} {dtype}")
    return buffer


T = TypeVar("T")

# Objects shared by the builds from one set of buffers (``BuildContext.shared``), by
# the id of their marker tensor in the buffers.
_SHARED: dict[int, Any] = {}


@dataclass
class BuildContext:
    """What ``Provider.build`` receives, once, after the weights are loaded."""

    spec: ModelSpec
    weights: ModelWeights  # this rank's plain weights (``weights.layers[i]``: LayerWeights)
    tp: int
    rank: int
    device: torch.device
    group: Any  # the TP group's torch.distributed process group (None at TP 1)
    deployment: Deployment
    # Executor-owned buffers by name, sized for ``max_rows``; providers add scratch
    # through ``scratch`` so layers share it.
    buffers: dict[str, torch.Tensor]
    aux_layers: tuple[int, ...]  # the layers whose input stream the drafter reads
    max_rows: int
    max_context: int
    # mailboxes[i]: what layer i's MoE publishes and the boundary after it gathers
    # (layer i + 1's input boundary; the final boundary for the last layer).
    mailboxes: list[Mailbox]
    # The resolved sub-op providers by kind (``experts``, ``attention_core``, ``all_reduce``, ``linear``).
    ops: dict[str, type[Provider]]
    # The reference transport of this rank (comm.Collectives): what the reference
    # providers' collectives run on; detached when a TP shard has no group.
    collectives: Any = None

    def layer(self, index: int) -> LayerWeights:
        return self.weights.layers[index]

    def scratch(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An executor-owned buffer shared by every layer, allocated at the first ask."""
        return scratch_buffer(self.buffers, self.device, name, shape, dtype)

    def shared(self, name: str, make: Callable[[], T]) -> T:
        """An object every build from these buffers shares (a collective workspace),
        made by ``make`` at the first ask. It is keyed by a marker tensor kept in the
        buffers under ``name`` that nothing else references, so it is forgotten when
        the buffers go (no cycle keeps it; the providers holding it release it by
        reference counting). The executor carries the markers a timing's
        ``collective_setup`` steps leave into its later timings, which so share one
        workspace of each kind instead of making one each."""
        marker = self.buffers.get(name)
        if marker is None:
            made = make()
            marker = self.buffers[name] = torch.empty(0, device=self.device)
            _SHARED[id(marker)] = made
            weakref.finalize(marker, _SHARED.pop, id(marker), None)
        return _SHARED[id(marker)]


@runtime_checkable
class Provider(Protocol):
    """The surface every provider class shares."""

    block: ClassVar[str]  # one of KINDS
    name: ClassVar[str]  # "pack.provider"
    # Order among supported candidates where nothing is measured (higher first).
    priority: ClassVar[int]

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        """Why this provider cannot serve ``deployment``, or None."""
        ...

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> Provider: ...

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        """Called for every bound KV cache (per layer: K/V views and metadata);
        raises if the cache is in a form the provider does not take."""
        ...


class BoundaryProvider(Provider, Protocol):
    """The input boundary of layer ``l`` (``build(ctx, l)``). Layer 0 (the front):
    the embeddings buffer (``ctx.buffers["embeddings"]``, bf16 [b, H]) into the fp32
    stream (its RMS norm, or fp32 of the already normed rows when
    ``step.normed_embeddings``). Later layers: the previous MoE's output gathered from
    ``ctx.mailboxes[l - 1]``, post_ffn_norm, the gated add into ``stream``. Then this
    layer's pre_qkv_proj_norm into ``out``. ``aux`` (fp32 [b, H]) receives the updated
    stream when layer l is an aux layer.

    Optional ``pair_producer(moe)`` (layers after the first, and the final boundary):
    called by the executor once this boundary and the MoE block that publishes into its
    mailbox (layer l - 1's; the last layer's for the final boundary) are built, where
    that MoE runs right before it (before any KV binding or capture, in the same order
    on every rank). A boundary that exchanges a column-sharded mailbox's blocks itself
    offers its exchange to the MoE provider (by a method both packs know, e.g. the cuda
    pack's ``publish_columns(mailbox) -> bool``); where the MoE agrees, the unpooler's
    epilogue pushes this rank's block to the peers and the boundary only takes theirs.
    The block still holds this rank's values, so the result is the same bits either way."""

    def run(self, step: Step, stream: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> None: ...


class AttentionProvider(Provider, Protocol):
    """The attention of layer l: QKV front (QKV+gate GEMM, QK norm, RoPE on sliding
    layers, K/V insert at the slot mapping), paged attention of the step with the
    o-norm and sigmoid gate, and o_proj. ``x`` bf16 [b, H] in; writes this rank's
    row-parallel o_proj partial (before any all-reduce) into ``partial`` bf16 [b, H]."""

    def run(self, step: Step, x: torch.Tensor, partial: torch.Tensor) -> None: ...


class AttentionBoundaryProvider(Provider, Protocol):
    """All-reduce of ``partial`` (TP > 1), post_attn_norm, the gated add into
    ``stream`` (fp32 [b, H], in place), pre_ffn_norm into ``out`` (bf16 [b, H]).

    Optional ``pair_attention(attention)``: called by the executor once layer l's
    attention block and this boundary are built (before any KV binding or capture, in
    the same order on every rank). A boundary that gathers a partial published into
    its own mailbox offers that mailbox to the attention provider (by a method of the
    attention provider's that both packs know, e.g. the cuda pack's
    ``publish_partial(mailbox) -> bool``); where the attention agrees, its o_proj
    epilogue publishes this rank's partial and the boundary only gathers. ``partial``
    still holds this rank's values, so the result is the same bits either way."""

    def run(self, partial: torch.Tensor, stream: torch.Tensor, out: torch.Tensor) -> None: ...


class MoEProvider(Provider, Protocol):
    """The MoE of layer l: router, routing, pooler and pre_expert_norm, the routed
    experts, the tail (post_expert_norm per route, weighted sum), the unpooler; its
    bf16 [b, H] output is published into ``ctx.mailboxes[l]``."""

    def run(self, step: Step, x: torch.Tensor) -> None: ...


class FinalProvider(Provider, Protocol):
    """The final boundary (``build(ctx, None)``): the last MoE's output gathered from
    ``ctx.mailboxes[-1]``, post_ffn_norm, the gated add, model.norm into ``out``
    (bf16 [b, H]); ``aux`` receives the final stream when the drafter reads it.
    Optional ``pair_producer(moe)``: as the input boundary's, with the last layer's MoE."""

    def run(self, step: Step, stream: torch.Tensor, out: torch.Tensor, aux: torch.Tensor | None) -> None: ...


class RoutedExpertsOp(Provider, Protocol):
    """Sub-op ``experts`` (bf16 experts) or ``experts_nvfp4`` (NVFP4 experts) of layer
    l: writes each route's expert output into ``rows`` bf16 [b, k, P] (this rank's
    partial sum under expert TP; zeros for experts other ranks hold under EP). Reads
    each selected expert's weights once."""

    def run(self, inputs: ExpertsInput, topk: RoutedTopk, rows: torch.Tensor) -> None: ...


class AttentionCoreOp(Provider, Protocol):
    """Sub-op ``attention_core`` of layer l: the paged attention of the step's rows
    over layer l's cache (``step.kv[l]``: causal within the step, the layer's window
    on sliding layers, the whole context on full ones, softmax scale
    ``spec.softmax_scale``): q bf16 [b, Hq, d] (normed and rotated, its K/V already
    in the cache) into ``out`` bf16 [b, Hq, d]."""

    def run(self, step: Step, q: torch.Tensor, out: torch.Tensor) -> None: ...


class AllReduceOp(Provider, Protocol):
    """Sub-op ``all_reduce`` (``build(ctx, None)``): sums bf16 [b, H] over the TP
    group in place, in a fixed rank order, so every rank holds the same bits."""

    def run(self, x: torch.Tensor) -> None: ...


class LinearOp(Provider, Protocol):
    """Sub-op ``linear`` of layer l: the dense GEMMs of the step over that layer's
    weights (``LINEAR_WEIGHTS``; ``build`` views, repacks or compiles all five).

    ``run(name, x, out)`` computes ``out[b, N] = x[b, K] @ W^T`` for
    ``W = getattr(ctx.layer(l), name)``, this rank's (TP-sharded) view: a
    column-sharded pooler or unpooler just has fewer rows N. ``x`` is bf16 [b, K]
    (b <= ``max_rows``, contiguous rows, any row stride); ``out`` is bf16 [b, N] for
    the bf16 weights; for ``router`` (fp32 [E, H]) ``x`` is the bf16 MoE input, taken
    to fp32, and ``out`` fp32 [b, E]. Capturable; allocates nothing."""

    def run(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None: ...
