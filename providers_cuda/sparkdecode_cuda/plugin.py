"""The pack's plug-in module (entry point `sparkdecode.providers`: cuda).

It registers only providers that are done and tested against the reference; the
table in this pack's README lists them.
"""

from sparkdecode.plugins import hookimpl

from .boundary import CudaAttentionBoundary, CudaBoundary, CudaFinal

PROVIDERS: tuple[type, ...] = (CudaBoundary, CudaAttentionBoundary, CudaFinal)


@hookimpl
def sparkdecode_providers() -> tuple[type, ...]:
    return PROVIDERS
