"""Keep FlashInfer's JIT-compiled modules between GPU machines, in one archive file.

FlashInfer compiles each kernel family on first use (26 to 82 s each on an H200
box) into ``~/.cache/flashinfer/<version>/<arch>/cached_ops/<name>/<name>.so``
and rechecks it with ninja on every load (sources, objects and flags). A fresh
machine has none of it. Here:

- ``save DEST`` writes every compiled module's ``.so`` into one tar archive, as
  ``<flashinfer version>/<arch>/cu<CUDA>/<name>/<name>.so``: DEST itself when it
  ends in ``.tar``, ``.tar.gz`` or ``.tar.xz`` (compressed as named), else
  ``DEST/flashinfer-jit.tar.gz``. ``--merge ARCHIVE`` (repeatable) also keeps the
  modules of an earlier archive that this machine did not compile (those it
  loaded from it), so the new archive replaces the old one; ``--split-mib N``
  cuts an archive larger than N MiB into ``DEST.000``, ``DEST.001``, ... (bytes in
  order), which ``load`` and ``--merge`` read as the whole;
- ``load ARCHIVE`` puts the modules saved for this FlashInfer, target arch and CUDA
  into FlashInfer's AOT folder (``flashinfer/data/aot/<name>/<name>.so``), which
  FlashInfer loads before trying a JIT build, without ninja. A module saved for
  another release, arch or CUDA is not loaded (it is under another key); one that
  fails to load is rebuilt by FlashInfer. A folder in the older layout (the same
  paths as files) loads too.

The key's CUDA is the one torch was built with; ``--cuda`` names it instead, as for
a torch without CUDA: modules built on a CPU machine (``FLASHINFER_CUDA_ARCH_LIST``
naming the arch, an nvcc of the GPU machine's CUDA) are saved with ``--cuda`` set to
the CUDA of the GPU machine's torch.

    python -m sparkdecode_flashinfer.jit_cache save DEST [--merge ARCHIVE] [--split-mib N] [--cuda V]
    python -m sparkdecode_flashinfer.jit_cache load ARCHIVE [--cuda V]

``scripts/device-install`` runs ``load`` from ``$SPARKDECODE_FLASHINFER_JIT``
(default ``.flashinfer-jit.tar.gz`` in the checkout, or its parts) when it exists.
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tarfile
from pathlib import Path

ARCHIVE = "flashinfer-jit.tar.gz"
SUFFIXES = {".tar": "", ".tar.gz": "gz", ".tar.xz": "xz"}
# <release>/<arch>/cu<CUDA>/<name>/<name>.so, the key's parts and the name plain words
MEMBER = re.compile(r"^(\w[\w.+-]*/\w[\w.+-]*/cu[\w.]+)/(\w[\w.+-]*)/\2\.so$")


def _paths(cuda: str | None = None) -> tuple[Path, Path, str]:
    """FlashInfer's JIT folder, its AOT folder, and the key of this install: release,
    target arch(s) and the CUDA that torch was built with (``cuda`` in its place)."""
    import torch
    from flashinfer.jit import env

    cuda = cuda or torch.version.cuda
    if cuda is None:
        raise ValueError("this torch has no CUDA: name the CUDA of the modules with --cuda (e.g. 13.0)")
    workspace = env.FLASHINFER_WORKSPACE_DIR  # <cache>/<release>/<arch>, e.g. .../0.7.2.post1/90a
    if workspace.parent.name != env.flashinfer_version:
        raise ValueError("FlashInfer has no target arch: no GPU is visible and FLASHINFER_CUDA_ARCH_LIST is unset")
    key = f"{env.flashinfer_version}/{workspace.name}/cu{cuda}"
    if not MEMBER.match(f"{key}/m/m.so"):
        raise ValueError(f"{key!r} is not a release/arch/cu<CUDA> key")
    return env.FLASHINFER_JIT_DIR, env.FLASHINFER_AOT_DIR, key


def _modules(root: Path) -> list[Path]:
    """``root/<name>/<name>.so`` for every module under ``root``."""
    if not root.is_dir():
        return []
    return sorted(p / f"{p.name}.so" for p in root.iterdir() if (p / f"{p.name}.so").is_file())


def archive_path(dest: Path) -> Path:
    """The archive ``save`` writes for DEST."""
    return dest if _compression(dest) is not None else dest / ARCHIVE


def _compression(path: Path) -> str | None:
    name = path.name
    return next((mode for suffix, mode in SUFFIXES.items() if name.endswith(suffix)), None)


def _parts(path: Path) -> list[Path]:
    """The archive's files: itself, or its split parts ``path.000``, ``path.001``, ..."""
    if path.is_file():
        return [path]
    return sorted(path.parent.glob(f"{path.name}.[0-9][0-9][0-9]")) if path.parent.is_dir() else []


def read_archive(path: Path) -> dict[str, bytes]:
    """``{member: bytes}`` of every module in the archive at ``path`` (or its parts);
    empty when there is none. Other members are ignored."""
    parts = _parts(path)
    if not parts:
        return {}
    data = b"".join(p.read_bytes() for p in parts)
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        for member in tar.getmembers():
            if member.isfile() and MEMBER.match(member.name):
                f = tar.extractfile(member)
                assert f is not None
                out[member.name] = f.read()
    return out


def save(
    dest: Path, merge: tuple[Path, ...] = (), split_mib: float | None = None, cuda: str | None = None
) -> tuple[list[Path], list[str]]:
    """Write the compiled modules (and ``merge``'s that are not compiled here) into
    one archive; returns (the files written, the members)."""
    jit, _, key = _paths(cuda)
    members = {f"{key}/{so.parent.name}/{so.name}": so.read_bytes() for so in _modules(jit)}
    for old in merge:
        for name, data in read_archive(old).items():
            members.setdefault(name, data)
    path = archive_path(dest)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in _parts(path):
        stale.unlink()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{_compression(path)}") as tar:
        for name in sorted(members):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(members[name]), 0o755
            tar.addfile(info, io.BytesIO(members[name]))
    data = buffer.getvalue()
    limit = None if split_mib is None else int(split_mib * 2**20)
    if limit is None or len(data) <= limit:
        path.write_bytes(data)
        return [path], sorted(members)
    written = []
    for i, start in enumerate(range(0, len(data), limit)):
        part = path.parent / f"{path.name}.{i:03d}"
        part.write_bytes(data[start : start + limit])
        written.append(part)
    return written, sorted(members)


def load(source: Path, cuda: str | None = None) -> list[Path]:
    """Put the modules saved under this install's key into FlashInfer's AOT folder
    (a module already there is left as it is). ``source``: an archive (or its
    parts), or a folder of the same paths."""
    _, aot, key = _paths(cuda)
    if source.is_dir():
        found = {f"{key}/{so.parent.name}/{so.name}": so.read_bytes() for so in _modules(source / key)}
    else:
        found = read_archive(source)
    loaded = []
    for name, data in sorted(found.items()):
        match = MEMBER.match(name)
        assert match is not None
        if match.group(1) != key:
            continue
        target = aot / match.group(2) / f"{match.group(2)}.so"
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        target.chmod(0o755)
        loaded.append(target)
    return loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sparkdecode_flashinfer.jit_cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("action", choices=("save", "load"))
    parser.add_argument("path", type=Path, help="save: the archive (.tar, .tar.gz, .tar.xz) or its folder; load: it")
    parser.add_argument("--merge", type=Path, action="append", default=[], help="save: also an earlier archive's")
    parser.add_argument("--split-mib", type=float, default=None, help="save: cut a larger archive into parts")
    parser.add_argument("--cuda", default=None, help="the key's CUDA (e.g. 13.0) in place of torch's")
    args = parser.parse_args(argv)
    try:
        if args.action == "save":
            files, members = save(args.path, tuple(args.merge), args.split_mib, args.cuda)
            size = sum(p.stat().st_size for p in files) / 2**20
            names = ", ".join(m.split("/")[-2] for m in members)
            print(
                f"flashinfer jit cache: saved {len(members)} modules in {', '.join(map(str, files))} ({size:.1f} MiB): {names}"
            )
        else:
            done = load(args.path, args.cuda)
            size = sum(p.stat().st_size for p in done) / 2**20
            print(
                f"flashinfer jit cache: loaded {len(done)} modules ({size:.1f} MiB): {', '.join(p.parent.name for p in done)}"
            )
    except ImportError as e:
        print(f"flashinfer jit cache: FlashInfer is not importable ({e})", file=sys.stderr)
        return 2
    except (tarfile.TarError, OSError) as e:
        print(f"flashinfer jit cache: {args.path}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"flashinfer jit cache: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
