"""The pack's plug-in module (entry point `sparkdecode.providers`: cute).

It registers only providers that are done and tested against the reference; the
table in this pack's README lists them.
"""

from sparkdecode.plugins import hookimpl

from .experts import CuteExperts
from .experts_mma import CuteExpertsMma
from .linear import CuteLinear
from .linear_mma import CuteLinearMma
from .linear_splitk import CuteLinearSplitK
from .linear_tma import CuteLinearTma, CuteLinearTmaEvictFirst

PROVIDERS: tuple[type, ...] = (
    CuteLinear,
    CuteLinearSplitK,
    CuteLinearMma,
    CuteLinearTma,
    CuteLinearTmaEvictFirst,
    CuteExperts,
    CuteExpertsMma,
)


@hookimpl
def sparkdecode_providers() -> tuple[type, ...]:
    return PROVIDERS
