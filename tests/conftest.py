"""The suite's shared conftest: pytest puts this folder on sys.path, so every test folder can
import the kits kept here (`_cli_kit`: run the CLI in process, check its error contract).

Cost is a marker, not a folder (markers registered in pyproject.toml, `--strict-markers`):
`gloo` (starts paddle.distributed gloo processes), `reference` (runs the scripts of
tests/reference in the reference libraries' own environments), `fuzz` (hypothesis property
tests), `slow` (about a second or more on a 2-core machine, measured with `--durations`).
`pytest_collection_modifyitems` below marks whole folders; tests elsewhere carry their own
marks (a module's `pytestmark` where every test of it pays the same slow fixture).
`pytest -m "not slow"` is the inner loop; `bash scripts/test.sh` runs everything.

`compiled_artifact(model, target, **options)` (session fixture) compiles once per distinct
option set and shares the artifact read-only; a test that writes into one takes a copy:
`compiled_artifact.copy(path, dest)`.
"""

import atexit
import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

# The suite never reads or fills the user's cache of source digests (ernie_ir.artifacts
# .source_digests): each session starts with an empty one of its own, removed at exit. CLI
# subprocesses inherit it.
if "ERNIE_IR_CACHE_DIR" not in os.environ:
    _CACHE = tempfile.mkdtemp(prefix="ernie-ir-test-cache-")
    os.environ["ERNIE_IR_CACHE_DIR"] = _CACHE
    atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

TESTS = Path(__file__).resolve().parent

# Folder (first part of the path under tests/) -> the markers every test in it gets.
FOLDER_MARKERS: dict[str, tuple[str, ...]] = {
    "distributed": ("gloo", "slow"),  # every test there launches paddle.distributed gloo ranks
    "reference": ("reference",),  # scripts for the reference envs; a test put there runs them
    "fuzz": ("fuzz",),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/ (given on the command line)
            continue
        for name in FOLDER_MARKERS.get(folder, ()):
            item.add_marker(name)


# -- the artifact factory ----------------------------------------------------------------------

def _tree(root: Path) -> dict[str, tuple[int, str]]:
    """Every path under root (root itself as ""): (mode, sha256 of a file's bytes or a link's
    target, "" for a folder)."""
    out: dict[str, tuple[int, str]] = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            digest = os.readlink(path)
        elif stat.S_ISREG(st.st_mode):
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            digest = ""
        out[path.relative_to(root).as_posix() if path != root else ""] = (stat.S_IMODE(st.st_mode), digest)
    return out


class ArtifactFactory:
    """`factory(model, target, **options) -> Path`: the artifact `ernie_ir.targets.compile_model(
    model, target, CompileOptions(out=..., **options))` writes (options: CompileOptions' fields or
    its flat flags, `quant="wint8"`, `lora_rank=4`, `tp=2`, ...), compiled on first use of those
    (model, target, options) and returned again for every later call in the session.

    The artifact is shared, so it is read-only: after the compile every file and folder loses
    its write bits, and since root ignores them the session's end also checks that no byte,
    mode or name changed (and fails naming the artifact if one did). A test that writes into an
    artifact (tampers with it, trains, records files, compiles over it) works on its own copy:
    `factory.copy(path, dest)`, writable, every path with the mode compile gave it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[tuple[str, str, str], Path] = {}  # (model, target, options) -> artifact
        self._modes: dict[Path, dict[str, int]] = {}  # artifact -> the modes compile gave
        self._trees: dict[Path, dict[str, tuple[int, str]]] = {}  # artifact -> as shared

    def __call__(self, model: str, target: str, **options: Any) -> Path:
        from ernie_ir.targets import CompileOptions, compile_model

        assert not {"out", "force"} & set(options), "the factory chooses where it writes"
        key = (model, target, repr(CompileOptions(**options)))  # equal options, however spelled
        if key not in self._built:
            out = self.root / str(len(self._built)) / "art"
            out.parent.mkdir()
            compile_model(model, target, CompileOptions(out=out, **options))
            tree = _tree(out)
            self._modes[out] = {rel: mode for rel, (mode, _) in tree.items() if not (out / rel).is_symlink()}
            for rel, mode in self._modes[out].items():
                (out / rel).chmod(mode & ~0o222)
            self._trees[out] = _tree(out)
            self._built[key] = out
        return self._built[key]

    def copy(self, src: Path, dest: Path) -> Path:
        """A writable copy of the factory's artifact `src` at `dest` (links copied as links),
        every path with the mode compile gave it. Returns dest."""
        shutil.copytree(src, dest, symlinks=True)
        for rel, mode in self._modes[src].items():
            (dest / rel).chmod(mode)
        return dest

    def check_untouched(self) -> None:
        """Fail if a shared artifact changed; make them writable again for pytest's cleanup."""
        changed = []
        for out, tree in self._trees.items():
            now = _tree(out)
            if now != tree:
                paths = sorted(rel or "." for rel in set(now) | set(tree) if now.get(rel) != tree.get(rel))
                changed.append(f"{out}: {', '.join(paths[:3])}{' ...' if len(paths) > 3 else ''}")
            for rel, mode in self._modes[out].items():
                if (out / rel).exists() and not (out / rel).is_symlink():
                    (out / rel).chmod(mode | 0o200)
        if changed:
            pytest.fail("a test wrote into an artifact of compiled_artifact (a test that changes one takes "
                        "compiled_artifact.copy(path, dest)): " + "; ".join(changed), pytrace=False)


@pytest.fixture(scope="session")
def compiled_artifact(tmp_path_factory: pytest.TempPathFactory):
    """compiled_artifact(model, target, **options) -> Path of a shared, read-only artifact (see
    ArtifactFactory); compiled_artifact.copy(path, dest) -> a writable copy."""
    factory = ArtifactFactory(tmp_path_factory.mktemp("artifacts"))
    yield factory
    factory.check_untouched()
