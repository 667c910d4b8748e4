"""requirements/*.txt resolve with a real resolver (uv), without installing anything.

The GPU set is resolved for its hosts (Linux x86_64, CPython 3.12), the CPU set for this interpreter,
both at requirements/uv.toml's `exclude-newer` date, so a pin that breaks a set fails here and a new
release on the index cannot. Needs PyPI: skipped, with the reason, only when the index is unreachable.
"""

import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tools/wheelhouse.py"

# Run as a script by the Makefile; loaded by path here (importing opd_patches would import verl).
_spec = importlib.util.spec_from_file_location("wheelhouse", SCRIPT)
wheelhouse = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheelhouse)


def _unreachable(url):
    try:
        urllib.request.urlopen(url, timeout=15).close()
        return None
    except OSError as e:
        return f"{url} unreachable ({e})"


@pytest.fixture(scope="module")
def pypi():
    """Skip when uv's index cannot be reached: a one-package resolution, revalidated past uv's cache."""
    proc = subprocess.run([wheelhouse.find_uv(), "pip", "compile", "-", "--config-file", wheelhouse.UV_CONFIG,
                           "--cache-dir", wheelhouse.CACHE / "uv", "--refresh-package", "uv", "--no-header",
                           "--quiet"], input="uv\n", capture_output=True, text=True, timeout=120)
    if proc.returncode:
        pytest.skip(f"the package index is unreachable ({proc.stderr.strip()[-300:]}): resolving "
                    f"requirements/*.txt needs it")


def pins(profile):
    """{name: version} of requirements/<profile>.txt; fails on a line that is not an exact pin."""
    out = {}
    for line in (REPO / f"requirements/{profile}.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==(\S+)", line)
            assert m, f"requirements/{profile}.txt: `{line}` is not an exact pin (name==version)"
            out[wheelhouse.norm(m[1])] = m[3]
    return out


def resolve(profile, tmp_path):
    out = tmp_path / f"pylock.{profile}.toml"
    proc = subprocess.run([sys.executable, SCRIPT, "resolve", "--profile", profile, "--out", out],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"requirements/{profile}.txt does not resolve:\n{proc.stdout}\n{proc.stderr}"
    return tomllib.loads(out.read_text())["packages"]


@pytest.mark.fresh_process
def test_gpu_profile_resolves_for_the_gpu_hosts(pypi, tmp_path):
    packages = resolve("gpu", tmp_path)
    got = {wheelhouse.norm(p["name"]): p["version"] for p in packages}
    for name, version in pins("gpu").items():
        assert got[name] == version, f"{name}: pinned {version}, resolved {got[name]}"
    # omegaconf's generated grammar imports only with the 4.9 runtime (math-verify allows 4.13)
    assert got["antlr4-python3-runtime"] == "4.9.3"
    # make wheelhouse builds sdist-only packages on the machine it runs on: only pure Python can cross over
    sdist_only = {p["name"] for p in packages if not p.get("wheels")}
    assert sdist_only == {"antlr4-python3-runtime"}, f"no manylinux_2_35 / cp312 wheel for {sdist_only}"


def test_cpu_profile_is_its_own_complete_resolution(pypi, tmp_path):
    source = wheelhouse.torch_source("cpu", None)
    if source == wheelhouse.TORCH_CPU_INDEX and (reason := _unreachable(source + "/torch/")):
        pytest.skip(f"the CPU torch: no local wheel in pip's find-links and {reason}")
    got = {wheelhouse.norm(p["name"]): p["version"] for p in resolve("cpu", tmp_path)}
    assert got.pop("torch") == pins("cpu")["torch"] + "+cpu"
    expected = {n: v for n, v in pins("cpu").items() if n != "torch"}
    assert got == expected, (f"added by the resolver: {sorted(got.keys() - expected.keys())}, unneeded: "
                             f"{sorted(expected.keys() - got.keys())}, differing: "
                             f"{sorted(n for n in got.keys() & expected.keys() if got[n] != expected[n])}")


def test_offline_install_reuses_a_preinstalled_torch_of_the_pinned_version():
    torch_version = importlib.metadata.version("torch")
    public = torch_version.split("+")[0]
    assert wheelhouse.preinstalled_torch(sys.executable, torch_version) == torch_version
    assert wheelhouse.preinstalled_torch(sys.executable, public) == torch_version  # 2.11.0+cu130 serves 2.11.0
    assert wheelhouse.preinstalled_torch(sys.executable, public + "+other") is None
    assert wheelhouse.preinstalled_torch(sys.executable, "1.0.0") is None


def test_wheelhouse_pip_ignores_local_wheel_folders():
    env = wheelhouse.pip_env({"PIP_FIND_LINKS": "/opt/wheels", "PIP_EXTRA_INDEX_URL": "file:///x", "PIP_CERT": "c"})
    assert env == {"PIP_CERT": "c", "PIP_CONFIG_FILE": "/dev/null", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def test_make_install_with_a_wheelhouse_installs_from_it_only(tmp_path):
    out = subprocess.run(["make", "-n", "install", f"VENV={tmp_path / 'venv'}", "PROFILE=gpu", f"WHEELHOUSE={tmp_path}"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"wheelhouse.py install --profile gpu --dir {tmp_path} --venv {tmp_path / 'venv'}" in out.stdout
    assert "pip install" not in out.stdout and "record-base" in out.stdout  # no index; the patch base still tagged
