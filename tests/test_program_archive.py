"""Program archives (pyscf_ipu.program_archive): what is packed comes back byte for byte, an archive
built for another setup is refused with nothing written, and an archive is data only (no path
outside the cache, no links, nothing the cache already holds overwritten)."""

from __future__ import annotations

import hashlib
import io
import json
import stat
import tarfile

import pytest

from pyscf_ipu.program_archive import MANIFEST, ArchiveError, machine, mismatch, pack, read_manifest, unpack


def fake_cache(root, files: dict[str, bytes]):
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


FILES = {"jax/jit_call-abc-cache": b"executable", "jax-programs/scf_program-1.program": b"\x00program\xff",
         "jax-programs/nested/assemble-2.program": b"assembly"}  # fmt: skip


def test_pack_then_unpack_installs_every_file_and_keeps_what_was_there(tmp_path):
    source = fake_cache(tmp_path / "a", {**FILES, "references/r.json": b"not a program"})
    packed = pack(source, tmp_path / "out" / "programs.tar.gz", {"method": "b3lyp5/sto-3g"})
    assert packed.files == len(FILES)  # the references are not programs
    target = fake_cache(tmp_path / "b", {"jax/jit_call-abc-cache": b"already here"})
    installed = unpack(packed.path, target)
    assert (installed.added, installed.present) == (len(FILES) - 1, 1)
    assert installed.manifest["method"] == "b3lyp5/sto-3g" and installed.manifest["machine"] == machine()
    assert (target / "jax/jit_call-abc-cache").read_bytes() == b"already here"
    for name in FILES:
        if name != "jax/jit_call-abc-cache":
            assert (target / name).read_bytes() == FILES[name]
            assert stat.S_IMODE((target / name).stat().st_mode) == 0o644  # readable in a shared cache
    assert not (target / "references").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["programs.tar.gz"]  # no temporary left


def test_an_empty_cache_is_not_packed(tmp_path):
    with pytest.raises(ArchiveError, match="holds no compiled programs"):
        pack(tmp_path, tmp_path / "p.tar.gz", {})
    assert not (tmp_path / "p.tar.gz").exists()


def archive(path, manifest: dict, members: list[tarfile.TarInfo | tuple[str, bytes]], hashes: dict | None = None):
    """A gzipped tar file of ``manifest`` first and then ``members`` (TarInfo, or (name, data)); the
    manifest lists the members' hashes, or ``hashes``."""
    if hashes is None:
        hashes = {m[0]: hashlib.sha256(m[1]).hexdigest() for m in members if isinstance(m, tuple)}
    with tarfile.open(path, "w:gz") as tar:
        data = json.dumps({"files": hashes, **manifest}).encode()
        info = tarfile.TarInfo(MANIFEST)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
            else:
                info = tarfile.TarInfo(member[0])
                info.size = len(member[1])
                tar.addfile(info, io.BytesIO(member[1]))
    return path


@pytest.mark.parametrize("key, name", [("source", "this package's source"), ("jax", "jax"), ("device", "the device"),
                                       ("platform", "the platform")])  # fmt: skip
def test_an_archive_built_elsewhere_is_refused_naming_the_difference(tmp_path, key, name):
    built = {**machine(), key: "elsewhere"}
    path = archive(tmp_path / "p.tar.gz", {"format": 1, "machine": built}, [("jax/x-cache", b"x")])
    with pytest.raises(ArchiveError, match=f"another setup \\({name}: built with elsewhere, here "):
        unpack(path, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_the_cpu_instruction_set_is_part_of_the_machine():
    here = machine()
    if here["platform"] != "cpu":
        pytest.skip("a CPU's flags are recorded only where the programs run on it")
    assert mismatch({**here, "cpu_flags": "0" * 16}, here).startswith("the CPU's instruction set")
    assert mismatch(here, here) is None


def test_links_devices_and_names_outside_the_cache_are_not_installed(tmp_path):
    link = tarfile.TarInfo("jax/link-cache")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    fifo = tarfile.TarInfo("jax/fifo-cache")
    fifo.type = tarfile.FIFOTYPE
    members = [("../outside", b"x"), ("jax/../../outside2", b"x"), ("/tmp/absolute", b"x"), ("other/file", b"x"),
               link, fifo, ("jax/good-cache", b"good")]  # fmt: skip
    path = archive(tmp_path / "p.tar.gz", {"format": 1, "machine": machine()}, members)
    cache = tmp_path / "deep" / "cache"
    installed = unpack(path, cache)
    assert installed.added == 1
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "deep/cache/jax/good-cache", "p.tar.gz"]  # fmt: skip


@pytest.mark.parametrize("content, message", [
    (b"not an archive at all", "not a readable program archive"),
    (None, "not a program archive \\(no manifest.json first\\)"),
    ("format", "of another format \\(99"),
])  # fmt: skip
def test_files_that_are_not_our_archives_are_refused(tmp_path, content, message):
    path = tmp_path / "p.tar.gz"
    if content is None:
        with tarfile.open(path, "w:gz") as tar:
            info = tarfile.TarInfo("jax/x")
            tar.addfile(info, io.BytesIO(b""))
    elif content == "format":
        archive(path, {"format": 99, "machine": machine()}, [])
    else:
        path.write_bytes(content)
    with pytest.raises(ArchiveError, match=message):
        read_manifest(path)
    with pytest.raises(ArchiveError, match="does not exist"):
        read_manifest(tmp_path / "missing.tar.gz")


def test_a_file_that_is_not_the_one_packed_is_refused_and_not_installed(tmp_path):
    """gzip checks its stream only at its end: each file's hash in the manifest is checked first."""
    members = [("jax/a-cache", b"good"), ("jax/b-cache", b"flipped bits")]
    hashes = {"jax/a-cache": hashlib.sha256(b"good").hexdigest(), "jax/b-cache": hashlib.sha256(b"other").hexdigest()}
    path = archive(tmp_path / "p.tar.gz", {"format": 1, "machine": machine()}, members, hashes)
    with pytest.raises(ArchiveError, match="is damaged \\(jax/b-cache is not the file it was built with\\); 1 of"):
        unpack(path, tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache" / "jax").iterdir()) == ["a-cache"]


def test_a_truncated_archive_installs_nothing_partial(tmp_path):
    source = fake_cache(tmp_path / "a", {f"jax/f{k}-cache": bytes(range(256)) * 400 for k in range(6)})
    whole = pack(source, tmp_path / "whole.tar.gz", {}).path.read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[: len(whole) * 2 // 3])
    with pytest.raises(ArchiveError, match="is damaged"):
        unpack(cut, tmp_path / "cache")
    for file in (tmp_path / "cache").rglob("*"):  # each file there is whole; none is a temporary
        assert file.is_dir() or file.read_bytes() == bytes(range(256)) * 400
