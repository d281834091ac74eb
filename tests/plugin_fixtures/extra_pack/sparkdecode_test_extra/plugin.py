"""The extra pack's provider: the reference attention boundary (so the numbers
stay exact) under another name, a higher priority and a context limit."""

from __future__ import annotations

from sparkdecode.plugins import hookimpl
from sparkdecode.protocols import Deployment
from sparkdecode.reference.providers import ReferenceAttentionBoundary

MAX_CONTEXT = 2048


class ExtraAttentionBoundary(ReferenceAttentionBoundary):
    block = "attention_boundary"
    name = "extra.attention_boundary"
    priority = 10

    @classmethod
    def unsupported(cls, deployment: Deployment) -> str | None:
        if deployment.max_context > MAX_CONTEXT:
            return f"needs max_context <= {MAX_CONTEXT}, got {deployment.max_context}"
        return None


@hookimpl
def sparkdecode_providers() -> tuple[type, ...]:
    return (ExtraAttentionBoundary,)
