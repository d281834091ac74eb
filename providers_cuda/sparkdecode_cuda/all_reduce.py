"""Sub-op ``all_reduce``: the one-shot Lamport all-reduce over peer memory
(lamport.py), bit-identical to the reference transport (fp32 in rank order 0..tp-1,
one rounding to bf16), so an executor using it equals the TP stock forward."""

from __future__ import annotations

import torch

from sparkdecode.protocols import BuildContext, Deployment

from .boundary import cuda_unsupported
from .lamport import collective_setup as lamport_setup
from .lamport import lamport_unsupported, workspace


class CudaAllReduce:
    block = "all_reduce"
    name = "cuda.all_reduce"
    priority = 10
    # With this transport the cuda pack's blocks gather column-sharded results (vLLM's
    # sharded pooler and unpooler) over the same Lamport mailbox, inside the kernels that
    # read them (lamport.device_gather): no torch.distributed collective in the step.
    device_gather = True

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return cuda_unsupported(deployment) or lamport_unsupported(deployment)

    def __init__(self, ctx: BuildContext):
        self.workspace = workspace(ctx)

    collective_setup = classmethod(lamport_setup)

    @classmethod
    def build(cls, ctx: BuildContext, layer: int | None) -> CudaAllReduce:
        return cls(ctx)

    def prepare_kv(self, kv) -> None:
        pass

    def run(self, x: torch.Tensor) -> None:
        if self.workspace is not None:  # None on a detached rank: left out, as the reference's
            self.workspace.all_reduce(x)
