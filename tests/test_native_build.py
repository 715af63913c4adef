"""Where the native CPU kernels' library comes from, and when it is trusted
(trioserve/engine/cpu/native_build.py), without torch and on any CPU: a fake
compiler "builds" a file of a few bytes, which is never loaded, so that what
is checked is the choice of library alone. tests/test_native.py builds and
loads the real one.

The rules: a cached library is used only when its sha256 is the one recorded
at its build (a changed or foreign one is refused, saying why, and not
rebuilt over); ``native/`` and below are private (mode 0700; another user's
directory, or one others may write, is refused); the compiler is part of the
key, and a restart without one finds the last build through the index; the
installed extension is used only when its record names these sources."""

from __future__ import annotations

import json
import logging
import os
import stat
import sysconfig
from pathlib import Path

import pytest

from trioserve.engine.cpu import native_build
from trioserve.engine.cpu.native_build import Unavailable

pytestmark = pytest.mark.unit

needs_headers = pytest.mark.skipif(
    not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file(),
    reason="no Python headers: a build (even a fake compiler's) stops before the compiler",
)

#: A compiler that answers ``--version`` with its first argument's line and
#: "compiles" by writing a few bytes to the ``-o`` path.
_FAKE_CC = """#!/bin/sh
if [ "$1" = "--version" ]; then echo "{version}"; exit 0; fi
out=""
while [ $# -gt 0 ]; do
    if [ "$1" = "-o" ]; then out="$2"; fi
    shift
done
printf 'built by {version}' > "$out"
"""


def _fake_cc(where: Path, version: str) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    cc = where / "cc"
    cc.write_text(_FAKE_CC.format(version=version))
    cc.chmod(0o755)
    return cc


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty trioserve cache, a fake compiler in ``$CC`` and no installed
    extension; ``native/`` in it is returned."""
    monkeypatch.setenv("TRIOSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(_fake_cc(tmp_path / "cc-1", "fakecc (Test) 1.0")))
    monkeypatch.setattr(native_build, "INSTALLED", tmp_path / "not-installed.so")
    return tmp_path / "cache" / "native"


def _libraries(native: Path) -> list[Path]:
    return sorted(native.glob("*/_trioserve_cpu*.so"))


@needs_headers
def test_a_build_is_private_and_recorded_with_its_sha256(cache: Path) -> None:
    library = native_build._cached()
    assert _libraries(cache) == [library]
    for directory in (cache, library.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    record = json.loads(Path(f"{library}.json").read_text())
    assert record["sha256"] == native_build._sha256(library)
    assert record["sources"] == native_build.sources_digest()
    assert record["compiler"].endswith(": fakecc (Test) 1.0")
    assert native_build._cached() == library  # found again, not rebuilt
    assert not list(cache.glob(".build-*"))  # no temporary directory left


@needs_headers
@pytest.mark.parametrize("how", ["appended to", "replaced by another library", "unrecorded"])
def test_a_library_that_is_not_the_one_built_is_refused_and_left_alone(
    cache: Path, how: str
) -> None:
    library = native_build._cached()
    if how == "appended to":
        with library.open("ab") as f:
            f.write(b"\0payload")
    elif how == "replaced by another library":
        library.write_bytes(Path(os.__file__).read_bytes())  # any other file
    else:
        Path(f"{library}.json").unlink()
    tampered = library.read_bytes()
    with pytest.raises(Unavailable) as refused:
        native_build._cached()
    reason = str(refused.value)
    assert reason.startswith(f"refused {str(library)!r}: ")
    if how == "unrecorded":
        assert "no record of its build" in reason
    else:
        assert "sha256" in reason and "recorded when it was built: it changed since" in reason
    assert refused.value.remedy == f"remove {str(library.parent)!r} to have it rebuilt"
    assert library.read_bytes() == tampered  # not rebuilt over


@needs_headers
def test_a_cache_directory_others_may_write_is_refused(cache: Path) -> None:
    library = native_build._cached()
    for directory, mode in ((cache, 0o770), (library.parent, 0o707)):
        directory.chmod(mode)
        with pytest.raises(Unavailable, match="its group or everyone may write it") as refused:
            native_build._cached()
        assert f"refused the kernels' cache directory {str(directory)!r}" in str(refused.value)
        assert f"(mode 0{mode:o})" in str(refused.value)
        directory.chmod(0o700)
    assert native_build._cached() == library


@needs_headers
def test_a_cache_directory_another_user_owns_is_refused(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = native_build._cached()
    if os.geteuid() == 0:
        os.chown(library.parent, 65534, 65534)  # nobody's, for real
        other = 65534
    else:
        # Not root: this process takes another uid, so that the directory it
        # made is someone else's as far as the check can tell.
        other = os.geteuid()
        monkeypatch.setattr(os, "geteuid", lambda: other + 1)
    with pytest.raises(Unavailable, match=f"it is owned by uid {other}, not by this user"):
        native_build._cached()


def test_the_compiler_is_part_of_the_key_and_the_sources_include_the_headers(
    tmp_path: Path,
) -> None:
    base = native_build._base()
    one = native_build.compiler_identity(str(_fake_cc(tmp_path / "a", "fakecc (Test) 1.0")))
    two = native_build.compiler_identity(str(_fake_cc(tmp_path / "b", "fakecc (Test) 2.0")))
    assert one == f"{tmp_path / 'a' / 'cc'}: fakecc (Test) 1.0"
    assert native_build._cache_key(base, one) != native_build._cache_key(base, two)
    # The same compiler elsewhere (another host's path) is another key too.
    moved = one.replace(str(tmp_path / "a"), str(tmp_path / "c"))
    assert native_build._cache_key(base, one) != native_build._cache_key(base, moved)
    # Every kernels*.c and kernels*.h file, by name and content.
    (tmp_path / "kernels.c").write_text("int x;\n")
    (tmp_path / "kernels_avx2.h").write_text("/* AVX2 */\n")
    sources = (tmp_path / "kernels.c", tmp_path / "kernels_avx2.h")
    before = native_build.sources_digest(sources)
    (tmp_path / "kernels_avx2.h").write_text("/* AVX2, changed */\n")
    assert native_build.sources_digest(sources) != before
    assert native_build.SOURCE in native_build.SOURCES
    assert list(native_build.SOURCES) == sorted(native_build.SOURCES, key=lambda p: p.name)


@needs_headers
def test_another_compiler_builds_its_own_and_a_restart_without_one_finds_the_last(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = native_build._cached()
    monkeypatch.setenv("CC", str(_fake_cc(tmp_path / "cc-2", "fakecc (Test) 2.0")))
    second = native_build._cached()
    assert second.parent != first.parent
    assert second.read_bytes() == b"built by fakecc (Test) 2.0"
    # No compiler: the index names the last build, which is checked as ever.
    monkeypatch.setenv("CC", str(tmp_path / "none" / "cc"))
    assert native_build._cached() == second
    with second.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(Unavailable, match="recorded when it was built"):
        native_build._cached()


def test_without_a_compiler_or_a_build_the_reason_says_how_to_get_them(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "none" / "cc"))
    with pytest.raises(Unavailable, match="no C compiler") as unavailable:
        native_build._cached()
    assert unavailable.value.remedy == native_build.TO_GET_THEM
    assert "apt-get install gcc python3-dev" in native_build.TO_GET_THEM
    assert not _libraries(cache)


@needs_headers
def test_the_installed_extension_is_used_only_when_built_from_these_sources(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trioserve.engine.cpu.native")
    installed = tmp_path / "site" / "_trioserve_cpu.so"
    record = native_build.build_installed(installed)
    assert record == Path(f"{installed}.json")
    monkeypatch.setattr(native_build, "INSTALLED", installed)
    assert native_build._installed() == installed
    assert f"native CPU kernels: the installed extension {installed}" in caplog.text
    # An editable install whose kernels.c changed since: stale, the cache's turn.
    stale = json.loads(record.read_text())
    record.write_text(json.dumps({**stale, "sources": "0" * 64}))
    caplog.clear()
    assert native_build._installed() is None
    assert "not used (built from other sources than these): using the cache" in caplog.text
    # Changed after its build: not used either.
    record.write_text(json.dumps(stale))
    with installed.open("ab") as f:
        f.write(b"\0")
    assert native_build._installed() is None
    assert not cache.exists()  # none of this touched the cache
