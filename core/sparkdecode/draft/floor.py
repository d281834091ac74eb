"""The memory floor of one draft step: the bytes it must read (to divide by the
copy bandwidth ``bench.floor.copy_bandwidth`` measures).

Bytes per block (the draft's tensors as stored):

- ``draft_context``: fc, the hidden norm, every layer's pre_qkv_proj_norm and the
  K and V rows of its fused projection (the context rows' K/V of every layer);
- ``draft_boundary(j)``: layer j - 1's post_ffn_norm and FFN residual coefficients
  (none for layer 0), layer j's pre_qkv_proj_norm; and the embedding rows of the
  query block for layer 0;
- ``draft_attention(j)``: the fused QKV(+o-gate) rows, o_proj, and the K and V the
  query block sees (window + rows - 1 keys on sliding layers, the whole context on
  full ones);
- ``draft_attention_boundary(j)``: post_attn_norm, the residual coefficients,
  pre_ffn_norm;
- ``draft_mlp(j)``: gate-up and down;
- ``draft_final``: the last post_ffn_norm and coefficients, the final norm;
- ``markov``: the LM head once, the Markov projection once per sampling step (the
  steps depend on each other and the projection, V x r, does not stay in L2 at the
  real widths: 103 MB), a Markov embedding row per step.

Activations, the K/V the step writes and the aux streams are not counted.
"""

from __future__ import annotations

from ..bench.floor import BlockBytes, nbytes
from .functional import Norm, Residual
from .weights import DraftWeights


def _norm(n: Norm) -> int:
    return 0 if n.weight is None else nbytes(n.weight)


def _residual(r: Residual) -> int:
    return 0 if r.alpha is None else nbytes(r.alpha, r.beta)


def draft_block_bytes(weights: DraftWeights, context: int, rows: int = 7) -> list[BlockBytes]:
    """Every draft block's bytes in step order for a query block of ``rows`` rows
    whose last query is at ``context - 1``."""
    spec, layers = weights.spec, weights.layers
    element = 2  # bf16 K and V
    out = [
        BlockBytes(
            "draft_context",
            "draft_context",
            None,
            nbytes(weights.fc)
            + _norm(weights.hidden_norm)
            + sum(_norm(x.pre_qkv_norm) + nbytes(x.kv_rows) for x in layers),
        )
    ]
    for j, layer in enumerate(layers):
        prev = layers[j - 1] if j else None
        boundary = _norm(layer.pre_qkv_norm)
        boundary += rows * spec.hidden_size * weights.embed.element_size() if prev is None else 0
        if prev is not None:
            boundary += _norm(prev.post_ffn_norm) + _residual(prev.ffn_residual)
        keys = context if layer.window is None else min(context, layer.window + rows - 1)
        kv = 2 * keys * layer.num_kv_heads * spec.head_dim * element
        kind = "draft_attention (sliding)" if layer.window is not None else "draft_attention (full)"
        out += [
            BlockBytes(f"draft_boundary.{j}", "draft_boundary", j, boundary),
            BlockBytes(f"draft_attention.{j}", kind, j, nbytes(layer.qkv, layer.o_proj) + kv),
            BlockBytes(
                f"draft_attention_boundary.{j}",
                "draft_attention_boundary",
                j,
                _norm(layer.post_attn_norm) + _residual(layer.attn_residual) + _norm(layer.pre_ffn_norm),
            ),
            BlockBytes(f"draft_mlp.{j}", "draft_mlp", j, nbytes(layer.gate_up, layer.down)),
        ]
    last = layers[-1]
    out.append(
        BlockBytes(
            "draft_final",
            "draft_final",
            None,
            _norm(last.post_ffn_norm) + _residual(last.ffn_residual) + _norm(weights.final_norm),
        )
    )
    markov = nbytes(weights.lm_head) + rows * (nbytes(weights.markov_w2) + nbytes(weights.markov_w1[0]))
    out.append(BlockBytes("markov", "markov", None, markov))
    return out


def draft_step_bytes(weights: DraftWeights, context: int, rows: int = 7) -> int:
    """The whole draft step's floor in bytes."""
    return sum(b.bytes for b in draft_block_bytes(weights, context, rows))
