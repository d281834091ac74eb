"""Sub-op ``linear`` in the CuTe DSL, second form: the layer's five dense GEMMs as
the split-K weight stream of gemv_splitk.py (tiles sized for the GPU's SM count,
x staged once per CTA in shared memory, the splits added in a fixed order by the
last CTA of each tile), launched with programmatic dependent launch.

Numerics as cute.linear's: the same products accumulated in fp32 in another order
(per split, then the splits in split order), rounded once to the output dtype;
results are identical from run to run. Checked on the H200 by
tests/test_gpu_cute_linear_v2.py.
"""

from __future__ import annotations

from typing import Any

import torch

from sparkdecode.protocols import LINEAR_WEIGHTS, BuildContext

from .common import compiled, pointer
from .linear import VECTOR_BYTES, CuteLinear, _Weight, weight_fp32

X_VECTOR = 8  # bf16 elements of x per 16-byte load


class SplitKWeight(_Weight):
    """One weight's compiled split-K kernel, its pointer and the shared workspace."""

    provider = "cute.linear_splitk"  # in error messages

    def __init__(self, name: str, w: torch.Tensor, max_rows: int, sms: int, plan: Any = None):
        """``plan`` (a plan of ``w``'s shape from ``make_plan``'s kernel) in place of
        the planner's."""
        fp32 = weight_fp32(name, w)
        if plan is None:
            plan = self.make_plan(w, fp32, max_rows, sms)
        if isinstance(plan, str):
            raise ValueError(f"{self.provider}: {name} {tuple(w.shape)}: {plan}")
        self.name, self.plan, self.w = name, plan, w
        self.vector = X_VECTOR
        self.out_dtype = w.dtype
        self.kernel = self.compile(plan)
        self.w_ptr = pointer(w, VECTOR_BYTES)  # TMA's global address too: 16-byte aligned
        self.buffers = ()  # share() sets the workspace and the counters

    @staticmethod
    def make_plan(w: torch.Tensor, fp32: bool, max_rows: int, sms: int) -> Any:
        """The planner's tiling of ``w`` (or its reason)."""
        from . import gemv_splitk

        return gemv_splitk.plan_splitk(w.shape[0], w.shape[1], fp32, max_rows, w.stride(0), sms)

    @staticmethod
    def compile(plan: Any) -> Any:
        """The compiled kernel of ``plan``, once per process."""
        from . import gemv_splitk

        return compiled(("gemv_splitk", plan), lambda: gemv_splitk.compile_splitk(plan))

    def share(self, workspace: torch.Tensor, counters: torch.Tensor) -> None:
        """The fp32 workspace and int32 tile counters (zero) the launches share."""
        if workspace.numel() < self.plan.workspace or counters.numel() < self.plan.tiles:
            raise ValueError(f"{self.provider} {self.name}: workspace or counters too small for {self.plan}")
        self.buffers = (pointer(workspace, VECTOR_BYTES), pointer(counters, 4))
        self.shared = (workspace, counters)  # held: the kernel has only their addresses


class XFirstSplitKWeight(SplitKWeight):
    """A weight on gemv_splitk's ``XFirstSplitKGemv``: x's chunk staged with all of a
    thread's loads in flight at once. The same bits."""

    @staticmethod
    def compile(plan: Any) -> Any:
        from . import gemv_splitk

        return compiled(
            ("gemv_splitk_x_first", plan), lambda: gemv_splitk.compile_splitk(plan, cls=gemv_splitk.XFirstSplitKGemv)
        )


class CuteLinearSplitK(CuteLinear):
    """Sub-op ``linear``: every dense weight of the layer streamed by the split-K GEMV.

    The workspace and counters are scratch shared by every layer of the same
    shapes: the kernels of one stream touch them only after ``griddepcontrol.wait``
    (the kernel before has finished), and each tile's counter is back at 0 when its
    kernel ends."""

    name = "cute.linear_splitk"
    bf16_weight: type[SplitKWeight] = SplitKWeight  # the bf16 weights' kernel
    router_weight: type[SplitKWeight] = SplitKWeight  # the fp32 router's (a split-K GEMV)

    def __init__(self, ctx: BuildContext, layer: int):
        lw = ctx.layer(layer)
        sms = torch.cuda.get_device_properties(lw.qkvg.device).multi_processor_count
        built = {}
        for name in LINEAR_WEIGHTS:  # the bf16 weights, then the fp32 ones (router_plan reads the former)
            w = getattr(lw, name)
            if not weight_fp32(name, w):
                built[name] = self.bf16_weight(name, w, ctx.max_rows, sms)
        for name in LINEAR_WEIGHTS:
            w = getattr(lw, name)
            if weight_fp32(name, w):
                built[name] = self.router_weight(
                    name, w, ctx.max_rows, sms, self.router_plan(name, w, built, ctx.max_rows, sms)
                )
        self.weights = {name: built[name] for name in LINEAR_WEIGHTS}
        self.share_scratch(ctx)

    def router_plan(self, name: str, w: torch.Tensor, bf16: dict[str, Any], max_rows: int, sms: int) -> Any:
        """The split-K plan of fp32 weight ``name`` (the router), given the built bf16
        weights; None: the planner's."""
        return None

    def share_scratch(self, ctx: BuildContext) -> None:
        """Every weight's workspace and tile counters: scratch of ``ctx`` (zeroed
        counters), sized for the largest of the weights' plans."""
        plans = [w.plan for w in self.weights.values()]
        size = max(1, *(p.workspace for p in plans))
        tiles = max(p.tiles for p in plans)
        workspace = ctx.scratch(f"{self.name}.workspace.{size}", (size,), torch.float32)
        counters = ctx.scratch(f"{self.name}.counters.{tiles}", (tiles,), torch.int32)
        counters.zero_()
        self.counters = counters
        for w in self.weights.values():
            w.share(workspace, counters)
