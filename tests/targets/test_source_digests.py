"""Source digests are remembered by stat: an unchanged checkpoint is not hashed again, a changed one is."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from ernie_ir.artifacts import source_digests
from ernie_ir.artifacts.source_digests import source_sha256


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The files source_sha256 actually hashed (a private cache dir, no racy window)."""
    monkeypatch.setenv("ERNIE_IR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ERNIE_IR_SOURCE_DIGESTS", raising=False)
    monkeypatch.setattr(source_digests, "RACY_SECONDS", 0.0)
    seen: list[str] = []
    real = source_digests.sha256_file

    def spy(path: str) -> str:
        seen.append(str(path))
        return real(path)

    monkeypatch.setattr(source_digests, "sha256_file", spy)
    return seen


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_an_unchanged_file_is_hashed_once(reads: list[str], tmp_path: Path) -> None:
    f = _file(tmp_path / "w.safetensors", b"a" * 5000)
    assert source_sha256(f) == hashlib.sha256(b"a" * 5000).hexdigest()
    assert source_sha256(f) == hashlib.sha256(b"a" * 5000).hexdigest()
    assert len(reads) == 1


def test_a_same_size_rewrite_or_a_replaced_file_is_hashed_again(reads: list[str], tmp_path: Path) -> None:
    f = _file(tmp_path / "w.bin", b"a" * 5000)
    source_sha256(f)
    time.sleep(0.05)  # past a clock tick: the rewrite gets a new ctime
    _file(f, b"b" * 5000)
    assert source_sha256(f) == hashlib.sha256(b"b" * 5000).hexdigest()
    _file(tmp_path / "other", b"c" * 5000).replace(f)  # a new inode under the same name
    assert source_sha256(f) == hashlib.sha256(b"c" * 5000).hexdigest()
    assert len(reads) == 3


def test_a_file_changed_just_before_hashing_is_not_remembered(reads: list[str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_digests, "RACY_SECONDS", 1.0)
    f = _file(tmp_path / "fresh", b"x" * 100)
    source_sha256(f)
    source_sha256(f)
    assert len(reads) == 2
    assert not list((tmp_path / "cache").rglob("*.json"))


def test_a_broken_entry_or_an_unwritable_cache_gives_the_digest(reads: list[str], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    f = _file(tmp_path / "w", b"q" * 300)
    want = hashlib.sha256(b"q" * 300).hexdigest()
    source_sha256(f)
    (entry,) = (tmp_path / "cache").rglob("*.json")
    for junk in ("{", "[]", json.dumps({"path": str(f.resolve()), "stat": "x", "sha256": "0" * 64}), ""):
        entry.write_text(junk)
        assert source_sha256(f) == want
    blocked = _file(tmp_path / "not-a-dir", b"")
    monkeypatch.setenv("ERNIE_IR_CACHE_DIR", str(blocked))
    assert source_sha256(f) == want
    monkeypatch.setenv("ERNIE_IR_SOURCE_DIGESTS", "off")
    monkeypatch.setenv("ERNIE_IR_CACHE_DIR", str(tmp_path / "cache2"))
    assert source_sha256(f) == want
    assert not (tmp_path / "cache2").exists()


def test_a_second_compile_of_a_checkpoint_does_not_hash_it_again(reads: list[str], tmp_path: Path) -> None:
    from parallel._parallel_testkit import tiny_config, write_paddle_checkpoint

    from ernie_ir.targets import CompileOptions, compile_model

    ckpt = tmp_path / "ckpt"
    write_paddle_checkpoint(ckpt, tiny_config("ernie-4.5-0.3b"))
    first = compile_model(str(ckpt), "cuda", CompileOptions(quant="wint8", out=tmp_path / "a"))
    hashed = len(reads)
    second = compile_model(str(ckpt), "ascend", CompileOptions(quant="wint8", out=tmp_path / "b"))
    assert hashed >= 2 and len(reads) == hashed  # every source file came from the cache
    m1 = json.loads((Path(first.out) / "manifest.json").read_text())["source"]["files"]
    m2 = json.loads((Path(second.out) / "manifest.json").read_text())["source"]["files"]
    assert m1 == m2 == {p.relative_to(ckpt).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in sorted(ckpt.rglob("*")) if p.is_file()}
