"""A cache of compiled programs as one file, to build on one machine and install on others like it.

A new process spends its first minutes tracing and compiling each size bucket's programs; the
program directory and JAX's persistent compilation cache (:mod:`pyscf_ipu.programs`,
:func:`pyscf_ipu.runtime.enable_compilation_cache`) spare a later process on the same machine that
work. :func:`pack` writes those two directories into a gzipped tar file with a manifest (what built
them: this package's source fingerprint, jax and jaxlib, the platform and the device, and for a
CPU its instruction-set flags, since XLA compiles CPU code for the host's own). :func:`unpack`
installs such a file into another cache after checking the manifest against the machine it runs
on: programs built elsewhere would not load (a different source or jax) or could not run (CPU code
using instructions this CPU lacks), so a mismatch is refused with a message naming it.

Unpacking never overwrites a file the cache already holds, writes each file through a temporary
name and a rename (a reader never sees part of one) once its hash is the manifest's, and takes only
regular files under the two directories: an archive is data, never a path outside the cache.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
ARCHIVE_FORMAT = 1
# The cache's two directories an archive holds: JAX's compiled executables and the exported programs
DIRECTORIES = ("jax", "jax-programs")
FILE_MODE = 0o644  # an archive's and an installed program's: readable by the other users of a shared cache


class ArchiveError(ValueError):
    """An archive that cannot be installed here: unreadable, not a program archive, or built for other
    code or another machine (the message says which)."""


def machine() -> dict[str, str]:
    """What decides whether compiled programs can be reused: this package's source and jax's versions,
    the platform and the device kind; on a CPU, a hash of its instruction-set flags."""
    import importlib.metadata

    import jax

    from .programs import source_fingerprint

    device = jax.devices()[0]
    out = {
        "source": source_fingerprint(),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "platform": device.platform,
        "device": device.device_kind,
    }
    if device.platform == "cpu":
        out["cpu_flags"] = _cpu_flags()
    return out


def _cpu_flags() -> str:
    """A short hash of the CPU's instruction-set flags (/proc/cpuinfo), or "unknown" where the OS does
    not say: XLA's CPU code may use any of them."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), None)
    except OSError:
        flags = None
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16] if flags else "unknown"


@dataclass(frozen=True)
class Packed:
    """What :func:`pack` wrote: the archive, its file count and bytes."""

    path: Path
    files: int
    bytes: int


def pack(cache: Path, path: Path, description: dict) -> Packed:
    """Write the programs of ``cache`` (its :data:`DIRECTORIES`) to the gzipped tar file ``path``, after a
    manifest of :func:`machine` and ``description`` (what they were built for: the settings, the
    buckets). The archive is written under a temporary name and renamed: a failed pack leaves no
    part behind. :class:`ArchiveError` if the cache holds no programs."""
    files = sorted(p for d in DIRECTORIES for p in (cache / d).rglob("*") if p.is_file() and not p.is_symlink())
    if not files:
        raise ArchiveError(f"{cache} holds no compiled programs to pack")
    # each file's hash, checked before it is installed: gzip's own check comes only at the stream's end
    hashes = {file.relative_to(cache).as_posix(): hashlib.sha256(file.read_bytes()).hexdigest() for file in files}
    manifest = {"format": ARCHIVE_FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine(), **description, "files": hashes}  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(descriptor, FILE_MODE)
    try:
        with os.fdopen(descriptor, "wb") as out, tarfile.open(fileobj=out, mode="w:gz") as tar:
            data = json.dumps(manifest, indent=1, sort_keys=True).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
            for file in files:
                tar.add(file, arcname=file.relative_to(cache).as_posix(), recursive=False)
        os.replace(temporary, path)
    except BaseException as err:
        Path(temporary).unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a full disk while writing: name the archive
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise
    return Packed(path, len(files), path.stat().st_size)


def read_manifest(path: Path) -> dict:
    """The manifest of the archive ``path``; :class:`ArchiveError` if it is not one this package wrote."""
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            member = tar.next()
            if member is None or member.name != MANIFEST or not member.isfile():
                raise ArchiveError(f"{path} is not a program archive (no {MANIFEST} first)")
            manifest = json.loads(tar.extractfile(member).read())
    except (OSError, tarfile.TarError, EOFError, zlib.error, json.JSONDecodeError, UnicodeDecodeError) as err:
        if isinstance(err, FileNotFoundError):
            raise ArchiveError(f"{path} does not exist") from None
        raise ArchiveError(f"{path} is not a readable program archive ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ARCHIVE_FORMAT:
        raise ArchiveError(f"{path} is a program archive of another format ({manifest.get('format')!r}, this "
                           f"package reads {ARCHIVE_FORMAT})" if isinstance(manifest, dict) else
                           f"{path} has no readable manifest")  # fmt: skip
    if not isinstance(manifest.get("machine"), dict) or not isinstance(manifest.get("files"), dict):
        raise ArchiveError(f"{path} has no readable manifest")
    return manifest


def mismatch(built: dict, here: dict) -> str | None:
    """What differs between the machine an archive was ``built`` on and this one (``here``), as one
    phrase; None when its programs can be reused here."""
    names = {"source": "this package's source", "jax": "jax", "jaxlib": "jaxlib", "platform": "the platform",
             "device": "the device", "cpu_flags": "the CPU's instruction set"}  # fmt: skip
    for key, name in names.items():
        if built.get(key) != here.get(key):
            return f"{name}: built with {built.get(key, 'none')!s}, here {here.get(key, 'none')!s}"
    return None


@dataclass(frozen=True)
class Installed:
    """What :func:`unpack` did: files added to the cache, files it already held, and the manifest."""

    added: int
    present: int
    manifest: dict


def unpack(path: Path, cache: Path) -> Installed:
    """Install the archive ``path`` into ``cache`` once its manifest matches this machine
    (:func:`machine`); :class:`ArchiveError` naming the difference otherwise, with nothing written.
    Files the cache holds are kept; the others are written through a temporary name and a rename."""
    manifest = read_manifest(path)
    difference = mismatch(manifest["machine"], machine())
    if difference is not None:
        raise ArchiveError(f"{path} was built for another setup ({difference}); its programs would not load "
                           "here: build them on this machine with qm1b warm")  # fmt: skip
    added = present = 0
    try:
        with tarfile.open(path, mode="r:gz") as tar:
            for member in tar:
                target = _target(cache, member)
                if target is None:
                    continue
                if target.exists():
                    present += 1
                    continue
                data = tar.extractfile(member).read()
                if hashlib.sha256(data).hexdigest() != manifest["files"].get(member.name):
                    raise ArchiveError(f"{path} is damaged ({member.name} is not the file it was built with); "
                                       f"{added} of its programs were installed")  # fmt: skip
                _install(data, target)
                added += 1
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as err:
        raise ArchiveError(f"{path} is damaged ({err}); {added} of its programs were installed") from None
    return Installed(added, present, manifest)


def _install(data: bytes, target: Path) -> None:
    """Write ``data`` to ``target`` through a temporary file and a rename; an OSError names ``target``."""
    temporary = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
        os.fchmod(descriptor, FILE_MODE)
        with os.fdopen(descriptor, "wb") as out:
            out.write(data)
        os.replace(temporary, target)
    except OSError as err:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        raise OSError(err.errno, err.strerror, str(target)) from None


def _target(cache: Path, member: tarfile.TarInfo) -> Path | None:
    """Where ``member`` goes in ``cache``: a regular file under one of :data:`DIRECTORIES`, by a plain
    relative name; None for anything else (the manifest, links, devices, absolute or climbing names)."""
    parts = Path(member.name).parts
    if not member.isfile() or len(parts) < 2 or parts[0] not in DIRECTORIES:
        return None
    if any(part in ("", ".", "..") for part in parts) or Path(member.name).is_absolute():
        return None
    return cache.joinpath(*parts)
