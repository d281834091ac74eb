"""Random tensors in vLLM's SM90 Marlin layout of NVFP4 experts, for kernels that
read it. The checkpoint's NVFP4 experts are packed into that layout by
sparkdecode.nvfp4_marlin.marlin_form (a torch model of vLLM's repack).
"""

from __future__ import annotations

import torch

from sparkdecode import nvfp4_marlin
from sparkdecode.weights import ExpertWeights


def random_marlin(
    num: int, hidden: int, inter: int, g: torch.Generator, device: str = "cpu", floor: bool = False
) -> ExpertWeights:
    """Any Marlin tensors (drawn on the CPU, then moved to ``device``): random words, scale bytes of every finite value (zero,
    fp16 subnormals, normals) and globals keeping block scales below experts.cu's bound. ``floor``: only
    the bytes vLLM's repack makes (0, or values of at least 2: bytes 0x80..0xf7)."""

    def words(k: int, n: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31, (num, k // 16, 2 * n), generator=g, dtype=torch.int64).to(torch.int32)

    def scales(k: int, n: int) -> torch.Tensor:
        if floor:  # 0x7f drawn stands for 0
            b = torch.randint(0x7F, 0xF8, (num, k // 16, n), generator=g, dtype=torch.uint8)
            return torch.where(b == 0x7F, 0, b).view(torch.float8_e4m3fn)
        return torch.randint(0, 0xF8, (num, k // 16, n), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)

    def glob() -> torch.Tensor:  # the largest byte is 480: 480 * 2^-9 * 2 < 4
        return (1 + torch.rand(num, generator=g)) * 2.0**-9 * nvfp4_marlin.GLOBAL_SHIFT

    tensors = (
        words(hidden, 2 * inter),
        scales(hidden, 2 * inter),
        glob(),
        words(inter, hidden),
        scales(inter, hidden),
        glob(),
    )
    return nvfp4_marlin.marlin_experts(*(x.to(device) for x in tensors), hidden, inter)
