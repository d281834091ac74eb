"""The named benchmark configs: stable names, so figures compare across commits.

| name | model | shard | contexts | a speed claim |
| --- | --- | --- | --- | --- |
| ``tiny`` | the tiny preset, 4 layers | TP 1 | 1024, 4096 (its longest) | no: a smoke run |
| ``tp1-real-L2`` | real widths, 2 layers, bf16 experts (26 GB a layer) | TP 1 | 4096, 32768 | yes |
| ``tp8-rank-L<N>-bf16`` | real widths, N layers, bf16 experts | rank 0 of TP 8, expert TP, pooler and unpooler replicated (as vLLM's SM90 path keeps them) | 4096, 32768 | yes, collectives left out |

``tp8-rank-Lmax-bf16`` is the TP-8 rank with as many layers as fit beside the
bench's own memory (``RESERVE_BYTES``) on this GPU; its record carries the
resolved name. A config whose weights do not fit is refused before anything is drawn.

Every config runs one request verifying ``ROWS`` tokens, with both routings
(``ROUTINGS``) unless the command narrows them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ..spec import ModelSpec

ROWS = 8  # one request verifying 1 + 7 drafted tokens
ROUTINGS = ("random", "correlated")
# Memory needed beside the weights: drawing the embedding and the LM head takes
# two fp32 temporaries of [V, H] (13.2 GB at the real widths); then the bench's
# two KV caches, graph pools, L2-flush and FlashInfer workspaces reuse it.
RESERVE_BYTES = 16 << 30
_TP8_RANK = re.compile(r"tp8-rank-L(\d+|max)-bf16")


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
    expert_format: str = "bf16"
    speed_claim: bool = True

    def spec(self) -> ModelSpec:
        return ModelSpec.preset(self.preset, self.layers)

    def weights_bytes(self, layers: int | None = None) -> int:
        """This rank's weights (bf16; the router and gate coefficients fp32), from the
        shapes alone: what drawing them will take."""
        s = ModelSpec.preset(self.preset, None)
        tp, H, P, I, E, d = self.tp, s.H, s.P, s.I, s.E, s.head_dim  # noqa: E741
        q, kv = s.num_attention_heads // tp * d, s.num_key_value_heads // tp * d
        experts = (E // tp) * 3 * I * P if self.expert_parallel == "ep" else E * 3 * (I // tp) * P
        per_layer = 2 * ((2 * q + 2 * kv) * H + H * q + 2 * P * H + experts + 6 * H + 2 * P) + 4 * (E * H + E + 4 * H)
        return (layers if layers is not None else self.layers) * per_layer + 2 * (2 * s.vocab_size * H + H)

    def fitting(self, free_bytes: int) -> BenchConfig:
        """This config with as many layers as fit in ``free_bytes`` (named for them)."""
        fixed = self.weights_bytes(0)
        layers = min(62, (free_bytes - RESERVE_BYTES - fixed) // (self.weights_bytes(1) - fixed))
        if layers < 1:
            raise BenchConfigError(f"not one layer of {self.name} fits in {free_bytes / 1e9:.1f} GB")
        return replace(self, name=f"tp8-rank-L{layers}-bf16", layers=int(layers))

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
    """The config of a name: ``tiny``, ``tp1-real-L2``, ``tp8-rank-L<N>-bf16`` or
    ``tp8-rank-Lmax-bf16`` (layers 0 until ``fitting`` resolves it)."""
    if name == "tiny":
        return BenchConfig(name, "tiny", 4, (1024, 4096), speed_claim=False)
    if name == "tp1-real-L2":
        return BenchConfig(name, "muse-spark-open", 2, (4096, 32768))
    match = _TP8_RANK.fullmatch(name)
    if match:
        if match.group(1) == "max":  # resolved against the GPU's free memory (``fitting``)
            return BenchConfig(name, "muse-spark-open", 0, (4096, 32768), tp=8, rank=0, expert_parallel="tp")
        layers = int(match.group(1))
        if not 1 <= layers <= 62:
            raise BenchConfigError(f"{name}: the model has 62 layers")
        return BenchConfig(name, "muse-spark-open", layers, (4096, 32768), tp=8, rank=0, expert_parallel="tp")
    raise BenchConfigError(f"unknown bench config {name!r}; configs: tiny, tp1-real-L2, tp8-rank-L<N>-bf16")
