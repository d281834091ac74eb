"""The pack's plug-in module (entry point `sparkdecode.providers`: flashinfer).

It registers only providers that are done and tested against the reference; the
table in this pack's README lists them. Importing it never imports FlashInfer
(the providers do, when built), so the pack loads and explains itself without it.
"""

from sparkdecode.plugins import hookimpl

from .allreduce import FlashInferAllReduce
from .prefill import FlashInferFa3, FlashInferPrefill
from .xqa import FlashInferXqa

PROVIDERS: tuple[type, ...] = (FlashInferXqa, FlashInferPrefill, FlashInferFa3, FlashInferAllReduce)


@hookimpl
def sparkdecode_providers() -> tuple[type, ...]:
    return PROVIDERS
