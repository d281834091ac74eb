"""Registers a provider class for the block "nonsense", which discovery rejects."""

from __future__ import annotations

from sparkdecode.plugins import hookimpl


class NonsenseProvider:
    block = "nonsense"
    name = "badclass.nonsense"
    priority = 1

    @classmethod
    def unsupported(cls, deployment: object) -> str | None:
        return None

    @classmethod
    def build(cls, ctx: object, layer: int | None) -> NonsenseProvider:
        return cls()

    def prepare_kv(self, kv: object) -> None:
        pass

    def run(self, *args: object) -> None:
        pass


@hookimpl
def sparkdecode_providers() -> tuple[type, ...]:
    return (NonsenseProvider,)
