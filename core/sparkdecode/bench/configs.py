"""The named benchmark configs: stable names, so figures compare across commits.

| name | model | shard | contexts | a speed claim |
| --- | --- | --- | --- | --- |
| ``tiny`` | the tiny preset, 4 layers | TP 1 | 1024, 4096 (its longest) | no: a smoke run |
| ``tp1-real-L2`` | real widths, 2 layers, bf16 experts (26 GB a layer) | TP 1 | 4096, 32768 | yes |
| ``tp8-rank-L<N>-bf16`` | real widths, N layers, bf16 experts | rank 0 of TP 8, expert TP, pooler and unpooler replicated (as vLLM's SM90 path keeps them) | 4096, 32768 | yes, collectives left out |
| ``tp8-rank-L<N>-nvfp4`` | as above, the routed experts of layers 1..N-2 in NVFP4, the first and last layer's bf16 (as the released checkpoint stores them at N = 62) | as above | 4096, 32768 | yes, collectives left out |
| ``tp8-rank-L<N>-nvfp4-marlin`` | as ``-nvfp4``, each NVFP4 layer's experts repacked as vLLM serves them on Hopper (its SM90 Marlin layout, ``nvfp4_marlin.marlin_form``) | as above | 4096, 32768 | yes, collectives left out |
| ``tp{2,4,8}-L<N>-bf16`` (``-nvfp4``, ``-nvfp4-marlin``) | real widths, N layers | every rank of TP 2, 4 or 8, one process each, expert TP (``ranks.py``) | 4096, 32768 | yes with one rank per GPU, the collectives in the time; ``--one-gpu``: no |
| ``tiny-tp2``, ``tiny-tp4``, ``tiny-tp8`` (``-nvfp4-marlin``) | the tiny preset (``tiny-tp8`` widths at TP 4 and 8), bf16 experts (or every layer's in Marlin's layout but the first and last) | every rank, as above | 300 | no: a smoke run |
| any of the TP names above with ``-sharded`` (``tp8-rank-L40-nvfp4-marlin-sharded``, ``tiny-tp2-sharded``) | as without | the pooler and the unpooler column-sharded over the ranks, as vLLM cuts them on SM100 and newer, or on SM90 with the text config's ``muse_spark_tep_shard_pooler`` and ``muse_spark_tep_shard_unpooler`` | as without | as without |

``tp8-rank-Lmax-bf16`` (or ``-nvfp4``, ``-nvfp4-marlin``, or ``tp{2,4,8}-Lmax-...``) is the TP-8 rank (each rank) with as many layers as fit beside the
bench's own memory (``RESERVE_BYTES``) on this GPU; its record carries the
resolved name. A config whose weights do not fit is refused before anything is drawn.

Every config runs one request verifying ``ROWS`` tokens, with both routings
(``ROUTINGS``) unless the command narrows them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..spec import ModelSpec
from ..weights import NVFP4_FORMATS

ROWS = 8  # one request verifying 1 + 7 drafted tokens
ROUTINGS = ("random", "correlated")
# Memory needed beside the weights: drawing the embedding and the LM head takes
# two fp32 temporaries of [V, H] (13.2 GB at the real widths); then the bench's
# two KV caches, graph pools, L2-flush and FlashInfer workspaces reuse it (and
# before them the Marlin repack of one layer's experts, a few GB: steer.draw_weights).
RESERVE_BYTES = 16 << 30
_TP8_RANK = re.compile(r"tp8-rank-L(\d+|max)-(bf16|nvfp4|nvfp4-marlin)")
_ALL_RANKS = re.compile(r"tp([248])-L(\d+|max)-(bf16|nvfp4|nvfp4-marlin)")
_TINY_RANKS = re.compile(r"tiny-tp([248])(-nvfp4-marlin)?")
SHARDED = "-sharded"  # a TP config's name with the pooler and the unpooler column-sharded


@dataclass(frozen=True)
class BenchConfig:
    """What one named config fixes: the model cut, the rank's shard, the contexts."""

    name: str
    preset: str
    layers: int
    contexts: tuple[int, ...]
    tp: int = 1
    rank: int = 0
    expert_parallel: str = "ep"  # "tp": an I-slice of every expert on each rank
    expert_format: str = "bf16"  # "nvfp4_marlin": drawn as "nvfp4", then repacked (steer.draw_weights)
    speed_claim: bool = True
    # Every rank of the TP group, one process each, its collectives in the step
    # (ranks.py); False: rank ``rank`` alone, detached when tp > 1.
    all_ranks: bool = False
    # The pooler and the unpooler column-sharded over the ranks (their output columns,
    # gathered by the consumer); False: replicated, as vLLM keeps them on SM90 by default.
    shard_projections: bool = False

    def __post_init__(self) -> None:
        if self.shard_projections:
            s = ModelSpec.preset(self.preset, None)
            if self.tp < 2 or s.P % self.tp or s.H % self.tp:
                raise BenchConfigError(
                    f"{self.name}: sharding the pooler and the unpooler needs TP > 1 dividing P = {s.P} and H = {s.H}"
                )
        if self.expert_format == "nvfp4_marlin":
            # Marlin's unpadded layout (the one read here): 64-wide tiles along P and I.
            s = ModelSpec.preset(self.preset, None)
            inter = s.I // self.tp if self.expert_parallel == "tp" else s.I
            if s.P % 64 or inter % 64:
                raise BenchConfigError(
                    f"{self.name}: Marlin's layout needs P = {s.P} and each rank's I = {inter} "
                    f"(I = {s.I}, {self.expert_parallel.upper()} {self.tp}) to be multiples of 64"
                )

    def spec(self) -> ModelSpec:
        return ModelSpec.preset(self.preset, self.layers)

    def weights_bytes(self, layers: int | None = None) -> int:
        """This rank's weights (bf16; the router and gate coefficients fp32; NVFP4
        experts as codes, e4m3 scales and fp32 global and input scales, in Marlin's
        layout codes, one-byte scales and fp32 globals), from the shapes alone: what
        drawing them will take."""
        s = ModelSpec.preset(self.preset, None)
        layers = self.layers if layers is None else layers
        tp, H, P, I, E, d = self.tp, s.H, s.P, s.I, s.E, s.head_dim  # noqa: E741
        q, kv = s.num_attention_heads // tp * d, s.num_key_value_heads // tp * d
        experts, inter = (E // tp, I) if self.expert_parallel == "ep" else (E, I // tp)
        projections = 2 * P * H // tp if self.shard_projections else 2 * P * H  # the pooler and the unpooler
        dense = 2 * ((2 * q + 2 * kv) * H + H * q + projections + 6 * H + 2 * P) + 4 * (E * H + E + 4 * H)
        bf16_experts = experts * 3 * inter * P * 2
        # codes (half a byte a value), one e4m3 scale per 16 values, globals (2 + 1) and input scales (2 + 1);
        # Marlin's layout: the same codes and one-byte scales, globals (1 + 1), no input scales
        fp32s = 2 if self.expert_format == "nvfp4_marlin" else 6
        nvfp4_experts = experts * (3 * inter * P // 2 + 3 * inter * P // 16 + 4 * fp32s)
        total = 2 * (2 * s.vocab_size * H + H)
        for i in range(layers):
            total += dense + (nvfp4_experts if self.nvfp4_layer(i, layers) else bf16_experts)
        return total

    def nvfp4_layer(self, index: int, layers: int | None = None) -> bool:
        """Whether layer ``index`` holds NVFP4 experts, in either layout (all but the
        first and last, as random_weights draws them and the released checkpoint
        stores them)."""
        layers = self.layers if layers is None else layers
        return self.expert_format in NVFP4_FORMATS and 0 < index < layers - 1

    def fitting(self, free_bytes: int) -> BenchConfig:
        """This config with as many layers as fit in ``free_bytes`` (named for them)."""
        layers = 0
        while layers < 62 and self.weights_bytes(layers + 1) + RESERVE_BYTES <= free_bytes:
            layers += 1
        if layers < 1:
            raise BenchConfigError(f"not one layer of {self.name} fits in {free_bytes / 1e9:.1f} GB")
        return replace(self, name=self.name.replace("Lmax", f"L{layers}"), layers=layers)

    def check_fits(self, free_bytes: int) -> None:
        need = self.weights_bytes() + RESERVE_BYTES
        if need > free_bytes:
            raise BenchConfigError(
                f"{self.name} needs {need / 1e9:.1f} GB ({self.weights_bytes() / 1e9:.1f} GB of weights), "
                f"{free_bytes / 1e9:.1f} GB are free"
            )


class BenchConfigError(ValueError):
    """An unknown config name."""


def named(name: str) -> BenchConfig:
    """The config of a name: ``tiny``, ``tp1-real-L2``, ``tp8-rank-L<N>-bf16``,
    ``tp8-rank-L<N>-nvfp4``, ``tp8-rank-L<N>-nvfp4-marlin`` or ``tp8-rank-Lmax-...``
    (layers 0 until ``fitting`` resolves it); every rank: ``tp{2,4,8}-L<N>-...`` (or
    ``-Lmax-``; bf16, nvfp4 or nvfp4-marlin), ``tiny-tp{2,4,8}`` (or ``-nvfp4-marlin``).
    A TP name ending in ``-sharded``: the same with the pooler and the unpooler
    column-sharded."""
    if name.endswith(SHARDED) and name != SHARDED:
        base = named(name[: -len(SHARDED)])
        if base.tp < 2:
            raise BenchConfigError(f"{name}: -sharded is for TP configs, {base.name} is TP 1")
        return replace(base, name=name, shard_projections=True)
    if name == "tiny":
        return BenchConfig(name, "tiny", 4, (1024, 4096), speed_claim=False)
    if name == "tp1-real-L2":
        return BenchConfig(name, "muse-spark-open", 2, (4096, 32768))
    match = _TINY_RANKS.fullmatch(name)
    if match:
        tp, marlin = int(match.group(1)), match.group(2) is not None
        preset, layers = ("tiny", 4) if tp == 2 else ("tiny-tp8", 2)  # tiny's 2 KV heads split over 2 ranks at most
        if marlin:
            layers = max(layers, 3)  # a middle layer in Marlin's layout
        return BenchConfig(
            name,
            preset,
            layers,
            (300,),
            tp=tp,
            expert_parallel="tp",
            expert_format="nvfp4_marlin" if marlin else "bf16",
            speed_claim=False,
            all_ranks=True,
        )
    for pattern, all_ranks in ((_TP8_RANK, False), (_ALL_RANKS, True)):
        match = pattern.fullmatch(name)
        if not match:
            continue
        *tp, count, fmt = match.groups()
        if count == "max":  # resolved against the GPU's free memory (``fitting``)
            layers = 0
        else:
            layers = int(count)
            if not 1 <= layers <= 62:
                raise BenchConfigError(f"{name}: the model has 62 layers")
        return BenchConfig(
            name,
            "muse-spark-open",
            layers,
            (4096, 32768),
            tp=int(tp[0]) if tp else 8,
            rank=0,
            expert_parallel="tp",
            expert_format=fmt.replace("-", "_"),
            all_ranks=all_ranks,
        )
    raise BenchConfigError(
        f"unknown bench config {name!r}; configs: tiny, tp1-real-L2, tp8-rank-L<N>-bf16, tp8-rank-L<N>-nvfp4, "
        "tp8-rank-L<N>-nvfp4-marlin, tp{2,4,8}-L<N>-bf16, tp{2,4,8}-L<N>-nvfp4, tp{2,4,8}-L<N>-nvfp4-marlin, "
        "tiny-tp{2,4,8}, tiny-tp{2,4,8}-nvfp4-marlin; any TP name with -sharded"
    )


def check_max_context(max_context: int | None, contexts: tuple[int, ...], positions: int) -> None:
    """``--max-context``: at least every context timed, at most the model's positions."""
    if max_context is None:
        return
    if max_context > positions:
        raise BenchConfigError(f"--max-context {max_context} is above the model's {positions} positions")
    if max_context < max(contexts):
        raise BenchConfigError(f"--max-context {max_context} is below the context {max(contexts)}")
