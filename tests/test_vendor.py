"""verl_vendor/vendor.py: the pinned wheel is verified, and tampering with installed verl is caught."""

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

VENDOR = Path(__file__).resolve().parents[1] / "verl_vendor" / "vendor.py"
_spec = importlib.util.spec_from_file_location("vendor", VENDOR)
vendor = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vendor)
PIN = vendor.PIN


def run(*args):
    return subprocess.run([sys.executable, str(VENDOR), *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="session")
def wheel():
    result = run("fetch")  # downloads only on the first run; later runs just verify
    assert result.returncode == 0, result.stderr
    return vendor.HERE / "wheels" / PIN["wheel"]


@pytest.fixture
def site_copy(tmp_path, wheel):
    """A copy of the installed verl package and its dist-info, laid out like site-packages."""
    site = Path(importlib.util.find_spec("verl").origin).parents[1]  # locates verl without importing it
    shutil.copytree(site / "verl", tmp_path / "verl", ignore=shutil.ignore_patterns("__pycache__"))
    dist_info = f"{PIN['name']}-{PIN['version']}.dist-info"
    shutil.copytree(site / dist_info, tmp_path / dist_info)
    return tmp_path


def test_installed_verl_matches_pin(wheel):
    result = run("check")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"verl {PIN['version']}: ")
    assert f"verified against {PIN['wheel']} sha256 {PIN['sha256']}" in result.stdout


def test_check_reports_each_tampered_file(site_copy):
    (site_copy / "verl" / "__pycache__").mkdir()
    (site_copy / "verl" / "__pycache__" / "protocol.cpython-311.pyc").write_bytes(b"bytecode is ignored")
    clean = run("check", "--site-packages", site_copy)
    assert clean.returncode == 0, clean.stderr

    protocol = site_copy / "verl" / "protocol.py"
    data = bytearray(protocol.read_bytes())
    data[100] ^= 1
    protocol.write_bytes(data)
    (site_copy / "verl" / "evil.py").write_text("print('not upstream')\n")
    (site_copy / "verl" / "trainer" / "main_ppo.py").unlink()

    result = run("check", "--site-packages", site_copy)
    assert result.returncode == 1
    out = result.stdout + result.stderr
    assert re.search(r"MODIFIED\s+verl/protocol\.py\b", out), out
    assert re.search(r"EXTRA\s+verl/evil\.py\b", out), out
    assert re.search(r"MISSING\s+verl/trainer/main_ppo\.py\b", out), out
    assert "pip install --force-reinstall --no-deps verl==" in out
    assert len(re.findall(r"^\s+(MODIFIED|EXTRA|MISSING|VERSION)\s", out, re.M)) == 3, out


def test_check_reports_wrong_dist_info_version(site_copy):
    dist_info = site_copy / f"{PIN['name']}-{PIN['version']}.dist-info"
    metadata = dist_info / "METADATA"
    metadata.write_text(metadata.read_text().replace(f"Version: {PIN['version']}", "Version: 0.0.1", 1))
    dist_info.rename(site_copy / f"{PIN['name']}-0.0.1.dist-info")
    result = run("check", "--site-packages", site_copy)
    assert result.returncode == 1
    assert "VERSION" in result.stderr and "0.0.1" in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["fetch", "check", "materialize"])
def test_corrupt_wheel_is_rejected(tmp_path, wheel, command):
    data = bytearray(wheel.read_bytes())
    data[len(data) // 2] ^= 1
    (tmp_path / PIN["wheel"]).write_bytes(data)
    result = run(command, "--wheel-dir", tmp_path)
    assert result.returncode == 1
    assert "sha256 mismatch" in result.stderr
    assert f"expected {PIN['sha256']}" in result.stderr
    assert f"actual   {hashlib.sha256(data).hexdigest()}" in result.stderr


def test_materialize_is_idempotent(tmp_path, wheel):
    with zipfile.ZipFile(wheel) as zf:
        expected = {n for n in zf.namelist() if n.startswith("verl/")}
    for _ in range(2):
        result = run("materialize", "--dest", tmp_path)
        assert result.returncode == 0, result.stderr
        files = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
        assert files == expected
