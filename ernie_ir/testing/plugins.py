"""Build and pip-install a plugin package inside a test, offline: `install_plugin`.

    site = install_plugin(tmp_path, "my-ops", {"my_ops": SOURCE},
                          {"ernie_ir.ops": {"swiglu": "my_ops"}})
    # then run `ernie-ir` with PYTHONPATH=site (as a user who pip-installed the package would)

The package carries its own stdlib-only PEP 517 backend (`backend-path`), so pip builds it
with `--no-index --no-build-isolation` (no network, no wheel-capable setuptools needed) and
installs it with `--target` into a folder of its own: the environment running the tests is
never modified. Its entry points are declared in `pyproject.toml`, exactly as a real package
declares them, and pip writes them to the installed dist-info.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

BACKEND = '''\
"""A stdlib-only PEP 517 backend: packs the modules beside it into a pure-Python wheel."""
import base64
import hashlib
import pathlib
import tomllib
import zipfile

HERE = pathlib.Path(__file__).parent


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    project = tomllib.loads((HERE / "pyproject.toml").read_text())["project"]
    dist = project["name"].replace("-", "_") + "-" + project["version"]
    files = {p.name: p.read_bytes() for p in HERE.glob("*.py") if p.name != "backend.py"}
    entry_points = "".join(
        f"[{group}]\\n" + "".join(f"{k} = {v}\\n" for k, v in items.items())
        for group, items in project.get("entry-points", {}).items())
    info = f"{dist}.dist-info"
    files[f"{info}/METADATA"] = (f"Metadata-Version: 2.1\\nName: {project['name']}\\n"
                                 f"Version: {project['version']}\\n").encode()
    files[f"{info}/WHEEL"] = (b"Wheel-Version: 1.0\\nGenerator: backend\\n"
                              b"Root-Is-Purelib: true\\nTag: py3-none-any\\n")
    files[f"{info}/entry_points.txt"] = entry_points.encode()
    record = [_record_line(name, data) for name, data in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\\n".join(record) + "\\n").encode()
    wheel = f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(pathlib.Path(wheel_directory) / wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return wheel
'''


def pyproject(name: str, entry_points: Mapping[str, Mapping[str, str]], version: str = "0.0.1") -> str:
    """The package's pyproject.toml: its name, version and entry points (group -> name -> target)."""
    lines = ["[build-system]", "requires = []", 'build-backend = "backend"', 'backend-path = ["."]', "",
             "[project]", f'name = "{name}"', f'version = "{version}"']
    for group, items in entry_points.items():
        lines += ["", f'[project.entry-points."{group}"]', *(f'{k} = "{v}"' for k, v in items.items())]
    return "\n".join(lines) + "\n"


def install_plugin(root: Path, name: str, modules: Mapping[str, str],
                   entry_points: Mapping[str, Mapping[str, str]], *, timeout: float = 300) -> Path:
    """Write package `name` (top-level `modules`: module name -> source) under `root`, pip-install
    it into `root/<name>-site` and return that folder (put it on PYTHONPATH to use the plugin).
    AssertionError with pip's output if the install fails."""
    pkg = root / f"{name}-src"
    pkg.mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(pyproject(name, entry_points), encoding="utf-8")
    (pkg / "backend.py").write_text(BACKEND, encoding="utf-8")
    for module, source in modules.items():
        (pkg / f"{module}.py").write_text(source, encoding="utf-8")
    site = root / f"{name}-site"
    run = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                          "--no-build-isolation", "--no-index", "--target", str(site), str(pkg)],
                         capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, f"pip install of {name} failed:\n{run.stdout}{run.stderr}"
    return site
