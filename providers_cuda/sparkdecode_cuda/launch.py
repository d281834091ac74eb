"""Load NVRTC cubins and launch their kernels on torch's current stream.

Launches go through cuda-python's ``cuLaunchKernelEx`` with the programmatic
stream serialization attribute (PDL): the kernel may start while the previous one
drains, and waits for it in ``pdl_wait()`` (kernels/common.cuh) before reading what
it wrote. A launch on a capturing stream is captured into the graph like any other.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .nvrtc import arch_of, compile_cubin

_MODULES: dict[tuple[int, str, tuple], tuple[object, dict[str, object]]] = {}


def _check(result: tuple, what: str) -> tuple:
    from cuda.bindings import driver

    err, *rest = result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    return tuple(rest)


def _ensure_context(device: torch.device) -> None:
    """Make torch's (primary) context current for the driver API on this thread, and
    check it is ``device``'s: the driver calls after this (module loads, allocations)
    go to the current context's GPU, which is torch's current device."""
    from cuda.bindings import driver

    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(device):
        torch.cuda.current_stream(device)  # the runtime binds the primary context
    (ctx,) = _check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) == 0:
        (dev,) = _check(driver.cuDeviceGet(index), "cuDeviceGet")
        (ctx,) = _check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _check(driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    (current,) = _check(driver.cuCtxGetDevice(), "cuCtxGetDevice")
    if int(current) != index:
        raise RuntimeError(
            f"the cuda pack builds for cuda:{index}, but this thread's current CUDA device is cuda:{int(current)}: "
            f"make cuda:{index} current first (torch.cuda.set_device), as each rank of a served model does"
        )


@dataclass(frozen=True)
class Arg:
    """A kernel argument with its C type: a pointer (int or tensor), int or float."""

    value: object
    ctype: type


def ptr(t: torch.Tensor | None) -> Arg:
    return Arg(0 if t is None else t.data_ptr(), ctypes.c_void_p)


def i32(v: int) -> Arg:
    return Arg(int(v), ctypes.c_int)


def i64(v: int) -> Arg:
    return Arg(int(v), ctypes.c_longlong)


def f32(v: float) -> Arg:
    return Arg(float(v), ctypes.c_float)


class Kernel:
    """One ``extern "C"`` kernel of a pack source, compiled for ``device``."""

    def __init__(
        self,
        source: str,
        name: str,
        device: torch.device,
        defines: dict[str, int | str] | None = None,
        options: tuple[str, ...] = (),
    ):
        from cuda.bindings import driver

        self.device = device
        _ensure_context(device)
        key = (device.index or 0, source, tuple(sorted((defines or {}).items())) + options)
        if key not in _MODULES:
            cubin = compile_cubin(source, arch_of(torch.cuda.get_device_capability(device)), defines, options)
            (module,) = _check(driver.cuModuleLoadData(cubin), f"cuModuleLoadData({source})")
            _MODULES[key] = (module, {})
        module, functions = _MODULES[key]
        if name not in functions:
            (functions[name],) = _check(
                driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})"
            )
        self.function = functions[name]
        self.name = name

    def allow_shared(self, nbytes: int) -> None:
        """Let launches ask for ``nbytes`` of dynamic shared memory (above 48 KB needs this)."""
        from cuda.bindings import driver

        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(driver.cuFuncSetAttribute(self.function, attribute, nbytes), f"shared memory of {self.name}")

    def launch(
        self,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: list[Arg],
        pdl: bool = True,
        shared: int = 0,
    ) -> None:
        """On torch's current stream with ``shared`` bytes of dynamic shared memory; capturable."""
        from cuda.bindings import driver

        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared
        config.hStream = driver.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        if pdl:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            config.attrs = [attr]
            config.numAttrs = 1
        else:
            config.numAttrs = 0
        params = (tuple(a.value for a in args), tuple(a.ctype for a in args))
        _check(driver.cuLaunchKernelEx(config, self.function, params, 0), f"launch of {self.name}")
