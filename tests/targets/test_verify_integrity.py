"""`verify` and every manifest reader (issue 14 item 5): links, non-regular files, a manifest of
the wrong shape, and names that would break the one-line error contract.

The rule (ernie_ir.artifacts.manifest): the tree is walked without following links; a link is
accepted only as a same-folder alias of a listed regular file (FastDeploy's
`rank{r}/model.safetensors -> weights.safetensors`); everything else that is not a listed
regular file is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ernie_ir.artifacts import ArtifactError, read_manifest, verify_artifact
from ernie_ir.cli.app import main
from ernie_ir.targets import CompileOptions, compile_model

MODEL = "ernie-4.5-0.3b@tiny"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "art"
    compile_model(MODEL, "kunlun", CompileOptions(out=out))
    return out


@pytest.fixture
def art(built: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "art"
    shutil.copytree(built, dest, symlinks=True)
    return dest


def one_error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    captured = capsys.readouterr()
    lines = [ln for ln in captured.err.splitlines() if ln.strip()]
    assert e.value.code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _write(root: Path, m: dict) -> None:
    (root / "manifest.json").write_text(json.dumps(m))


def test_a_link_inside_the_artifact_that_is_not_an_alias_at_or_below_its_folder_is_refused(art: Path) -> None:
    # rank0/graph.ir and graph.ir hold the same bytes for one rank, so only the link gives it away
    # (the old rule, "resolves inside the artifact", let it pass).
    f = art / "rank0" / "graph.ir"
    assert f.read_bytes() == (art / "graph.ir").read_bytes()
    f.unlink()
    f.symlink_to(Path("..") / "graph.ir")
    with pytest.raises(ArtifactError, match=r"rank0/graph\.ir is a symbolic link to \.\./graph\.ir, "
                                            r"not an alias of a listed file in its folder or below"):
        verify_artifact(art)


def test_a_link_down_into_a_rank_folder_must_name_a_listed_file(art: Path) -> None:
    # FastDeploy's one-rank layout links the top level to rank0/'s bytes; the same rules hold
    top = art / "graph.ir"
    top.unlink()
    top.symlink_to("rank0/graph.ir")  # the same bytes for one rank, listed: an alias
    verify_artifact(art)
    top.unlink()
    top.symlink_to("rank0/nothing.ir")
    with pytest.raises(ArtifactError, match=r"graph\.ir is a symbolic link to rank0/nothing\.ir, which does "
                                            r"not exist"):
        verify_artifact(art)
    top.unlink()
    top.symlink_to("rank0/./graph.ir")
    with pytest.raises(ArtifactError, match="not an alias of a listed file in its folder or below"):
        verify_artifact(art)


def test_a_link_to_a_folder_is_refused_not_skipped(art: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (art / "rank0" / "more").symlink_to(tmp_path / "elsewhere")  # the old walk never saw it
    with pytest.raises(ArtifactError, match=r"rank0/more is not listed in manifest\.json"):
        verify_artifact(art)


def test_a_same_folder_alias_of_a_listed_file_verifies(art: Path) -> None:
    """FastDeploy's rank{r}/model.safetensors: listed with its target's sha256."""
    (art / "rank0" / "model.safetensors").symlink_to("weights.safetensors")
    m = _manifest(art)
    m["files"]["rank0/model.safetensors"] = m["files"]["rank0/weights.safetensors"]
    _write(art, m)
    verify_artifact(art)
    (art / "rank0" / "model.safetensors").unlink()  # a chain (alias of an alias) is refused
    (art / "rank0" / "w2").symlink_to("weights.safetensors")
    (art / "rank0" / "model.safetensors").symlink_to("w2")
    m["files"]["rank0/w2"] = m["files"]["rank0/weights.safetensors"]
    _write(art, m)
    with pytest.raises(ArtifactError, match="which is not a listed regular file"):
        verify_artifact(art)


def test_a_dangling_alias_and_a_link_out_of_the_artifact_are_refused(art: Path, tmp_path: Path) -> None:
    m = _manifest(art)
    m["files"]["rank0/model.safetensors"] = m["files"]["rank0/weights.safetensors"]
    _write(art, m)
    (art / "rank0" / "model.safetensors").symlink_to("gone.safetensors")
    with pytest.raises(ArtifactError, match="does not exist"):
        verify_artifact(art)
    (art / "rank0" / "model.safetensors").unlink()
    shutil.copy(art / "rank0" / "weights.safetensors", tmp_path / "copy.safetensors")
    (art / "rank0" / "model.safetensors").symlink_to(tmp_path / "copy.safetensors")
    with pytest.raises(ArtifactError, match="resolves outside the artifact"):
        verify_artifact(art)


def test_a_fifo_is_refused_without_reading_it(art: Path) -> None:
    os.mkfifo(art / "rank0" / "pipe")
    m = _manifest(art)
    m["files"]["rank0/pipe"] = "0" * 64
    _write(art, m)
    with pytest.raises(ArtifactError, match=r"rank0/pipe is not a regular file"):
        verify_artifact(art)  # would block forever if it opened the FIFO


def test_a_manifest_that_is_a_link_is_refused(art: Path, tmp_path: Path) -> None:
    real = tmp_path / "m.json"
    shutil.move(art / "manifest.json", real)
    (art / "manifest.json").symlink_to(real)
    with pytest.raises(ArtifactError, match="is not a regular file"):
        read_manifest(art)


@pytest.mark.parametrize("field,value,message", [
    ("backends", "interpreter", "field 'backends' must be a list, not a string"),
    ("backends", ["interpreter", 3], "field 'backends.1' must be a string, not a number"),
    ("files", ["graph.ir"], "field 'files' must be an object of sha256s, not a list"),
    ("parallel", {"world_size": "2"}, "field 'parallel.world_size' must be an integer, not a string"),
    ("mode", "serving", "field 'mode' must be one of the known values, not a string"),
    ("weights", "yes", "field 'weights' must be true or false, not a string"),
    ("kernel_plan", [], "field 'kernel_plan' must be an object, not a list"),
    ("rank_files", {"rank0": ["graph.ir"]}, "field 'rank_files.rank0' must be an object, not a list"),
    ("format_version", True, "format version True is not supported"),
])
def test_a_manifest_of_the_wrong_shape_is_one_line(art: Path, capsys: pytest.CaptureFixture[str], field: str,
                                                   value: object, message: str) -> None:
    m = _manifest(art)
    m[field] = value
    _write(art, m)
    assert message in one_error_line(capsys, "verify", str(art))
    for argv in (["run", str(art), "--tokens", "1,2"], ["plan", str(art), "--target", "kunlun"]):
        assert message in one_error_line(capsys, *argv)


def test_a_deeply_nested_manifest_is_one_line(art: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (art / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "manifest.json is not valid JSON" in one_error_line(capsys, "verify", str(art))


def test_names_with_a_newline_still_give_one_line(art: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    m = _manifest(art)
    m["files"]["rank0/evil\nname"] = "0" * 64
    _write(art, m)
    line = one_error_line(capsys, "verify", str(art))
    assert "rank0/evil\\nname" in line
    del m["files"]["rank0/evil\nname"]
    _write(art, m)
    weird = tmp_path / "two\nlines"
    shutil.copytree(art, weird, symlinks=True)
    (weird / "rank0" / "graph.ir").write_text("changed")
    line = one_error_line(capsys, "verify", str(weird))
    assert "two\\nlines" in line and "rank0/graph.ir was modified" in line
    (weird / "extra\nfile").write_text("x")
    assert "extra\\nfile is not listed" in one_error_line(capsys, "verify", str(weird))


def test_a_warning_before_an_error_still_gives_one_error_line(art: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    import ernie_ir.targets

    def warn_then_fail(path: object) -> None:
        warnings.warn("a library's warning\nover two lines", UserWarning, stacklevel=1)
        raise ArtifactError("artifact x: rank0/a\nb is missing")

    monkeypatch.setattr(ernie_ir.targets, "verify_artifact", warn_then_fail)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["verify", str(art)])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2
    assert lines == ["warning: a library's warning over two lines", "error: artifact x: rank0/a b is missing"]
