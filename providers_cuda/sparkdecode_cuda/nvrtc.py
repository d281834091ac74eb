"""Compile the pack's CUDA C++ to a cubin with NVRTC, cached on disk.

The .cu sources ship as package data (``kernels/``) and are read with
importlib.resources. No nvcc and no torch extension build: NVRTC (the
``nvidia-cuda-nvrtc`` wheel, or the CUDA toolkit's) compiles straight to SASS for
the device's architecture (``sm_90a`` on Hopper). Cubins are cached under
``~/.cache/sparkdecode/cubin`` keyed by the NVRTC version, the architecture, the
options and the hash of every source read. NVRTC needs no GPU, so CI compiles every
kernel on the CPU.
"""

from __future__ import annotations

import hashlib
import os
import re
from importlib import resources
from pathlib import Path

KERNELS = "sparkdecode_cuda.kernels"


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source (the message holds its log)."""


def nvrtc_unavailable() -> str | None:
    """Why NVRTC cannot be used here, or None."""
    try:
        from cuda.bindings import nvrtc
    except ImportError:
        return "cuda-python (cuda-bindings) is not installed"
    try:
        err, *_ = nvrtc.nvrtcVersion()
    except Exception as e:  # the library itself failed to load
        return f"NVRTC could not be loaded ({type(e).__name__}: {' '.join(str(e).split())})"
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return f"NVRTC could not be loaded ({err})"
    return None


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion")
    return major, minor


def source(name: str) -> str:
    return resources.files(KERNELS).joinpath(name).read_text()


def _headers(text: str) -> dict[str, str]:
    """The pack's own headers a source includes (by quoted name), transitively."""
    out: dict[str, str] = {}
    pending = re.findall(r'#include\s+"([^"]+)"', text)
    while pending:
        name = pending.pop()
        if name not in out:
            out[name] = source(name)
            pending.extend(re.findall(r'#include\s+"([^"]+)"', out[name]))
    return out


def cache_dir() -> Path:
    root = os.environ.get("SPARKDECODE_CACHE", str(Path.home() / ".cache" / "sparkdecode"))
    return Path(root) / "cubin"


def compile_cubin(
    name: str, arch: str, defines: dict[str, int | str] | None = None, options: tuple[str, ...] = ()
) -> bytes:
    """The cubin of kernel source ``name`` for ``arch`` (e.g. "sm_90a")."""
    text = source(name)
    headers = _headers(text)
    opts = [f"--gpu-architecture={arch}", "-std=c++17", *options]
    opts += [f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    key = hashlib.sha256(repr((nvrtc_version(), arch, opts, text, sorted(headers.items()))).encode()).hexdigest()[:40]
    path = cache_dir() / f"{Path(name).stem}-{key}.cubin"
    if path.exists():
        return path.read_bytes()
    cubin = _compile(name, text, headers, opts)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(cubin)
    tmp.replace(path)
    return cubin


def _compile(name: str, text: str, headers: dict[str, str], opts: list[str]) -> bytes:
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(
        text.encode(),
        name.encode(),
        len(headers),
        [v.encode() for v in headers.values()],
        [k.encode() for k in headers],
    )
    _check(err, "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = bytearray(size)  # never b" " * size: a size of 1 is CPython's shared b" "
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CompileError(f"NVRTC failed on {name} ({' '.join(opts)}):\n{log.decode(errors='replace')}")
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN")
        return bytes(cubin)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _check(err: object, what: str) -> None:
    from cuda.bindings import nvrtc

    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{what} failed: {err}")


def arch_of(capability: tuple[int, int]) -> str:
    """The NVRTC target of a GPU: the arch-specific ``a`` variant on Hopper (sm_90a)."""
    major, minor = capability
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"
