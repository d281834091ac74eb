# Source for the bench layouts the notes name (bench/NOTES.md), as `sparkdecode bench`
# options: ALLPINS pins every kind to the layout the resolver takes for the 62-layer
# TP-8 rank step on the H200 (so a run skips the in-place timing), but for experts_nvfp4
# and linear, the ones ahead in the 40-layer step on an H100 (bench/NOTES.md v42 and v51;
# their H200 step not yet measured); a variant replaces one
# pin and names its provider class with --provider, e.g.
#
#   source scripts/layouts.sh
#   scripts/step-compare all="$ALLPINS" \
#       v="${ALLPINS/linear=cute.linear_tma_evict_first/linear=NAME} --provider MODULE:CLASS"
PINS="--pin boundary=cuda.boundary --pin attention=cuda.attention --pin attention_boundary=cuda.attention_boundary"
PINS="$PINS --pin moe=cuda.moe --pin final=cuda.final --pin experts=cuda.experts_slice2 --pin all_reduce=cuda.all_reduce"
ALLPINS="$PINS --pin experts_nvfp4=cuda.experts_nvfp4_marlin_v3_half4_scatter_up_queue_na_spare_carry2 --pin attention_core=flashinfer.fa2"
ALLPINS="$ALLPINS --pin linear=cute.linear_tma_evict_first"
export PINS ALLPINS
