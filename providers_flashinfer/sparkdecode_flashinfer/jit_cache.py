"""Keep FlashInfer's JIT-compiled modules between GPU machines.

FlashInfer compiles each kernel family on first use (26 to 82 s each on an H200
box) into ``~/.cache/flashinfer/<version>/<arch>/cached_ops/<name>/<name>.so``
and rechecks it with ninja on every load (sources, objects and flags). A fresh
machine has none of it. Here:

- ``save DIR`` copies every compiled module's ``.so`` into
  ``DIR/<flashinfer version>/<arch>/cu<CUDA>/<name>/<name>.so``;
- ``load DIR`` puts the modules saved for this FlashInfer, target arch and CUDA
  into FlashInfer's AOT folder (``flashinfer/data/aot/<name>/<name>.so``), which
  FlashInfer loads before trying a JIT build, without ninja. A module saved for
  another release, arch or CUDA is not loaded (it is under another key); one
  that fails to load is rebuilt by FlashInfer.

    python -m sparkdecode_flashinfer.jit_cache save|load DIR

``scripts/device-install`` runs ``load`` from ``$SPARKDECODE_FLASHINFER_JIT``
(default ``.flashinfer-jit`` in the checkout) when it exists.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def _paths() -> tuple[Path, Path, str]:
    """FlashInfer's JIT folder, its AOT folder, and the key of this install: release,
    target arch(s) and the CUDA that torch was built with."""
    import torch
    from flashinfer.jit import env

    arch = env.FLASHINFER_WORKSPACE_DIR.name  # e.g. 90a
    return env.FLASHINFER_JIT_DIR, env.FLASHINFER_AOT_DIR, f"{env.flashinfer_version}/{arch}/cu{torch.version.cuda}"


def _modules(root: Path) -> list[Path]:
    """``root/<name>/<name>.so`` for every module under ``root``."""
    if not root.is_dir():
        return []
    return sorted(p / f"{p.name}.so" for p in root.iterdir() if (p / f"{p.name}.so").is_file())


def save(dest: Path) -> list[Path]:
    """Copy the compiled modules into ``dest`` under this install's key."""
    jit, _, key = _paths()
    saved = []
    for so in _modules(jit):
        target = dest / key / so.parent.name / so.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)
        saved.append(target)
    return saved


def load(source: Path) -> list[Path]:
    """Put the modules saved under this install's key into FlashInfer's AOT folder
    (a module already there is left as it is)."""
    _, aot, key = _paths()
    loaded = []
    for so in _modules(source / key):
        target = aot / so.parent.name / so.name
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, target)
        loaded.append(target)
    return loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparkdecode_flashinfer.jit_cache", description=__doc__)
    parser.add_argument("action", choices=("save", "load"))
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    try:
        done = save(args.dir) if args.action == "save" else load(args.dir)
    except ImportError as e:
        print(f"flashinfer jit cache: FlashInfer is not importable ({e})", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in done) / 2**20
    verb = "saved" if args.action == "save" else "loaded"
    print(
        f"flashinfer jit cache: {verb} {len(done)} modules ({size:.1f} MiB): {', '.join(p.parent.name for p in done)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
