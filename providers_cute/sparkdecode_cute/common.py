"""What every provider of this pack shares: the ``unsupported`` reasons, and the
glue between torch and compiled CuTe DSL kernels (pointers, the stream, a compile
cache). The kernels are compiled in ``build`` and launched in ``run`` on torch's
current stream, so they are captured in CUDA graphs like any other launch.

The kernel modules themselves (gemv.py, ...) import no torch, so they compile for
``CUTE_DSL_ARCH=sm_90a`` on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch

from sparkdecode.deployment import import_problem
from sparkdecode.protocols import Deployment, LayerKV

# The CuTe DSL release these kernels are written and tested against.
CUTLASS_DSL_VERSION = "4.8.1"
CUTLASS_DSL_PIN = f"nvidia-cutlass-dsl=={CUTLASS_DSL_VERSION}"


def cute_unsupported(d: Deployment) -> str | None:
    """A Hopper GPU and nvidia-cutlass-dsl 4.8.1 (read from the ``Deployment``; the
    DSL is imported, once, only where everything else holds)."""
    version = d.libraries.get("cutlass")
    if version is None:
        return f"the CuTe DSL is not installed (pip install {CUTLASS_DSL_PIN})"
    if version != CUTLASS_DSL_VERSION:
        return f"nvidia-cutlass-dsl {version} is installed; this pack is built against {CUTLASS_DSL_PIN}"
    if d.device != "cuda" or d.capability is None:
        return "needs a CUDA GPU"
    if d.capability != (9, 0):
        major, minor = d.capability
        return f"built and tested for SM90 (Hopper, sm_90a); this GPU is SM{major}{minor}"
    # The DSL and the driver bindings the kernels launch through, importable.
    return import_problem("cutlass") or import_problem("cuda.bindings.driver")


class CuteProvider:
    """Base of this pack's providers: the pack's support check; no KV form of its own."""

    priority = 20

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        return cute_unsupported(deployment)

    def prepare_kv(self, kv: tuple[LayerKV, ...]) -> None:
        pass


_DTYPES: dict[torch.dtype, str] = {torch.bfloat16: "BFloat16", torch.float32: "Float32", torch.int32: "Int32"}


def pointer(t: torch.Tensor, align: int) -> Any:
    """A CuTe gmem pointer to ``t``'s data, asserting ``align`` bytes (checked)."""
    import cutlass
    import cutlass.cute as cute

    address = t.data_ptr()
    if address % align:
        raise ValueError(f"{tuple(t.shape)} {t.dtype} at {address:#x} is not {align}-byte aligned")
    dtype = getattr(cutlass, _DTYPES[t.dtype])
    return cute.runtime.make_ptr(dtype, address, cute.AddressSpace.gmem, assumed_align=align)


def current_stream() -> Any:
    """torch's current stream on the current device as a ``CUstream``."""
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


_compiled: dict[Hashable, Any] = {}


def compiled(key: Hashable, compile_fn: Callable[[], Any]) -> Any:
    """The compiled kernel for ``key`` (its shapes and options), compiled once per
    process by ``compile_fn``: layers of the same shapes share it."""
    kernel = _compiled.get(key)
    if kernel is None:
        kernel = _compiled[key] = compile_fn()
    return kernel


def driver_value(call: tuple) -> Any:
    """The value of a cuda-python driver call's (error, value); RuntimeError where it failed."""
    err, *value = call
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return value[0] if len(value) == 1 else None


def loaded_kernels(kernel: Any) -> list:
    """The driver's ``CUkernel`` handles of a compiled DSL function's kernels once it has
    been called (the DSL 4.8.1 loads its cubin as a ``cudaLibrary_t``, ``cuda_library``, at
    the first call); [] before that."""
    import cuda.bindings.driver as drv

    kernels = []
    for lib in getattr(getattr(kernel, "jit_module", None), "cuda_library", None) or []:
        library = drv.CUlibrary(int(lib))  # the runtime's cudaLibrary_t is the driver's handle
        count = int(driver_value(drv.cuLibraryGetKernelCount(library)))
        kernels += list(driver_value(drv.cuLibraryEnumerateKernels(count, library)))
    return kernels


def set_carveout(kernel: Any, percent: int, device: int) -> int:
    """Ask the driver for ``percent`` of the SM's unified L1 as shared memory when
    ``kernel`` (a compiled DSL function, called once) runs on ``device``: the function
    attribute ``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT`` set on each of its
    kernels. The DSL's own ``preferred_smem_carveout`` launch option does not reach the
    loaded library in 4.8.1 (the attribute reads -1 after it). Returns the kernels set;
    RuntimeError where the function is not loaded yet."""
    import cuda.bindings.driver as drv

    handles = loaded_kernels(kernel)
    if not handles:
        raise RuntimeError("the kernel is not loaded yet: call it once first")
    attribute = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    for handle in handles:
        driver_value(drv.cuKernelSetAttribute(attribute, percent, handle, drv.CUdevice(device)))
    return len(handles)
