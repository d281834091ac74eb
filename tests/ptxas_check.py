"""ptxas's report of a kernel source compiled by NVRTC (--ptxas-options=-v): each
kernel's registers, stack, spills and static shared memory, for the CPU tests that
check a kernel fits the blocks an SM it is launched on."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple


class Usage(NamedTuple):
    """A kernel's resources from ptxas's report."""

    registers: int  # a thread's
    stack: int  # stack frame bytes
    spills: int  # spill store + load bytes
    smem: int  # static shared memory bytes a block


def _compiled(source: str, defines: dict[str, int], opts: list[str], get: Callable[[Any, Any], Any]) -> tuple[Any, str]:
    """The pack's ``source`` compiled by NVRTC under ``defines`` and ``opts`` (asserted to
    succeed): what ``get(nvrtc, program)`` takes from the program before it is destroyed,
    and the compile log."""
    from cuda.bindings import nvrtc as cu_nvrtc

    from sparkdecode_cuda import nvrtc

    text = nvrtc.source(source)
    headers = nvrtc._headers(text)
    opts = [*opts, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    _, prog = cu_nvrtc.nvrtcCreateProgram(
        text.encode(),
        source.encode(),
        len(headers),
        [v.encode() for v in headers.values()],
        list(map(str.encode, headers)),
    )
    try:
        (err,) = cu_nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = cu_nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # never b" " * size: an empty log's size 1 is CPython's shared b" "
        cu_nvrtc.nvrtcGetProgramLog(prog, log)
        report = log.decode(errors="replace")
        assert err == cu_nvrtc.nvrtcResult.NVRTC_SUCCESS, report
        return get(cu_nvrtc, prog), report
    finally:
        cu_nvrtc.nvrtcDestroyProgram(prog)


def kernel_usage(source: str, defines: dict[str, int], options: tuple[str, ...]) -> dict[str, Usage]:
    """Per kernel of the pack's ``source`` (kernels/) under ``defines`` for sm_90a."""
    opts = ["--gpu-architecture=sm_90a", "-std=c++17", *options, "--ptxas-options=-v"]
    _, report = _compiled(source, defines, opts, lambda nvrtc, prog: None)
    usage = {}
    for name, body in re.findall(r"Compiling entry function '(\w+)'(.*?)(?=Compiling entry function|\Z)", report, re.S):
        frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", body)
        regs = re.search(r"Used (\d+) registers", body)
        smem = re.search(r"(\d+) bytes smem", body)
        assert frame and regs, report
        usage[name] = Usage(int(regs[1]), int(frame[1]), int(frame[2]) + int(frame[3]), int(smem[1]) if smem else 0)
    return usage


def assert_spill_free(source: str, defines: dict[str, int], options: tuple[str, ...]) -> dict[str, Usage]:
    """Every kernel of ``source`` under ``defines`` without spills; their Usage."""
    usage = kernel_usage(source, defines, options)
    assert all(u.spills == 0 for u in usage.values()), usage
    return usage


def kernel_ptx(source: str, defines: dict[str, int], options: tuple[str, ...]) -> str:
    """The PTX NVRTC makes of the pack's ``source`` under ``defines`` for sm_90a."""

    def ptx(nvrtc: Any, prog: Any) -> bytearray:
        _, size = nvrtc.nvrtcGetPTXSize(prog)
        out = bytearray(size)
        nvrtc.nvrtcGetPTX(prog, out)
        return out

    out, _ = _compiled(source, defines, ["--gpu-architecture=compute_90a", "-std=c++17", *options], ptx)
    return out.decode(errors="replace")


def ptx_entry(ptx: str, kernel: str) -> str:
    """One kernel's PTX, from its ``.entry`` to the next one's (or the end)."""
    start = ptx.index(f".entry {kernel}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start : end if end >= 0 else len(ptx)]


def blocks_per_sm(registers: int, threads: int = 256) -> int:
    """Blocks of ``threads`` an SM's 64K registers hold (a warp's registers allocated in 256s)."""
    per_warp = -(-registers * 32 // 256) * 256
    return 65536 // (per_warp * (threads // 32))
