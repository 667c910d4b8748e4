"""The submission patch (tools/patch.py, `make patch` / `make patch-check`).

Runs on a scratch git repository holding a copy of this checkout's working tree (tracked and untracked,
not ignored), committed as the base: the user's own repository and index are never touched.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import patch

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "verl_vendor" / "wheels"


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    """The project as a user receives it: one commit holding a snapshot of this checkout, no opd-base tag."""
    root = tmp_path_factory.mktemp("origin")
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / rel)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "the project as the user received it")
    return root


@pytest.fixture
def project(origin, tmp_path):
    """A fresh clone of the origin with the base tag, as a user's checkout after `make install`."""
    clone = tmp_path / "project"
    subprocess.run(["git", "clone", "-q", str(origin), str(clone)], check=True)
    assert "tagged HEAD" in patch.record_base(clone)
    return clone


def test_record_base_tags_once(project):
    base = git(project, "rev-parse", "HEAD").strip()
    (project / "README.md").write_text("changed\n")
    git(project, "commit", "-qam", "later work")
    assert "already at" in patch.record_base(project)
    assert git(project, "rev-parse", "opd-base").strip() == base


def test_write_includes_committed_modified_added_and_deleted_files(project, tmp_path):
    # work committed after the base, uncommitted edits, a new untracked file, a deletion
    (project / "recipes" / "k1.yaml").write_text((project / "recipes" / "k1.yaml").read_text() + "# tuned\n")
    git(project, "commit", "-qam", "tune k1")
    (project / "README.md").write_text((project / "README.md").read_text() + "\n## My change\n")
    (project / "opd_patches" / "ops" / "extra.py").write_text('"""A new module."""\n')
    (project / "tests" / "test_extra.py").write_bytes(b"\x00\x01binary\n")
    (project / "tests" / "test_stats.py").unlink()
    (project / "opd_patches" / "__pycache__").mkdir(exist_ok=True)
    (project / "opd_patches" / "__pycache__" / "x.pyc").write_bytes(b"ignored")
    (project / "notes.txt").write_text("outside the surface\n")
    index_before = git(project, "ls-files", "--stage")

    out = tmp_path / "opd.patch"
    result = patch.write(project, None, out)

    assert sorted(result["files"]) == [("A", "opd_patches/ops/extra.py"), ("A", "tests/test_extra.py"),
                                       ("D", "tests/test_stats.py"), ("M", "README.md"), ("M", "recipes/k1.yaml")]
    assert result["outside"] == ["notes.txt"] and result["bytes"] == out.stat().st_size
    assert result["base"] == git(project, "rev-parse", "opd-base").strip()
    assert patch.header_base(out.read_bytes()) == result["base"]
    assert git(project, "ls-files", "--stage") == index_before  # the user's index is untouched

    # the patch turns a clean checkout of the base into the working tree's surface, byte for byte
    replay = tmp_path / "replay"
    subprocess.run(["git", "clone", "-q", str(project), str(replay)], check=True)
    git(replay, "checkout", "-q", "--detach", "opd-base")
    git(replay, "apply", str(out))
    for rel in ("README.md", "recipes/k1.yaml", "opd_patches/ops/extra.py", "tests/test_extra.py"):
        assert (replay / rel).read_bytes() == (project / rel).read_bytes(), rel
    assert not (replay / "tests" / "test_stats.py").exists()
    assert not (replay / "notes.txt").exists() and not (replay / "opd_patches" / "__pycache__").exists()

    if not WHEELS.is_dir():
        pytest.skip(f"{WHEELS} absent (verl_vendor/vendor.py fetch): the vendor check needs the pinned wheel")
    report = patch.check(project, out, None, WHEELS)
    assert any("applies cleanly" in line for line in report)
    assert any(line.startswith("vendor check: verl 0.9.1") for line in report)


def test_a_patch_touching_verl_vendor_is_refused(project, tmp_path, capsys):
    pin = project / "verl_vendor" / "pin.toml"
    pin.write_text(pin.read_text() + "# edited\n")
    bad = tmp_path / "bad.patch"
    bad.write_text(git(project, "diff", "opd-base"))
    assert patch.write(project, None, tmp_path / "good.patch")["outside"] == ["verl_vendor/pin.toml"]
    with pytest.raises(patch.PatchError, match="touches verl_vendor/pin.toml: upstream VERL and its pin stay unchanged"):
        patch.check(project, bad, None, WHEELS)
    assert patch.main(["--repo", str(project), "check", "--patch", str(bad)]) == 1
    assert "verl_vendor/pin.toml" in capsys.readouterr().err


def test_touched_paths_include_both_sides_of_renames_and_quoted_names(project, tmp_path):
    readme = project / "README.md"
    readme.write_text("-- a removed line that looks like a file header\n" + readme.read_text())
    git(project, "commit", "-qam", "a line starting with --")
    git(project, "tag", "-f", "opd-base")
    readme.write_text(readme.read_text().split("\n", 1)[1])  # its removal shows as "--- a removed line..."
    (project / "tests" / "tab\there é.py").write_text("x = 1\n")  # git C-quotes this name
    git(project, "mv", "verl_vendor/vendor.py", "tests/vendor.py")  # a rename out of verl_vendor/
    git(project, "add", "-A")
    data = git(project, "diff", "-M", "--cached", "opd-base").encode()
    assert patch.touched(data) == ["README.md", "tests/tab\there é.py", "tests/vendor.py", "verl_vendor/vendor.py"]
    bad = tmp_path / "rename.patch"
    bad.write_bytes(data)
    with pytest.raises(patch.PatchError, match="touches verl_vendor/vendor.py"):
        patch.check(project, bad, None, WHEELS)


def test_a_patch_outside_the_surface_is_refused(project, tmp_path):
    (project / "pyproject.toml").write_text((project / "pyproject.toml").read_text() + "\n# edited\n")
    bad = tmp_path / "bad.patch"
    bad.write_text(git(project, "diff", "opd-base"))
    with pytest.raises(patch.PatchError, match="outside the editable surface .*pyproject.toml"):
        patch.check(project, bad, None, WHEELS)


def test_without_a_recorded_base_the_error_says_what_to_do(project, tmp_path):
    git(project, "tag", "-d", "opd-base")
    with pytest.raises(patch.PatchError, match=r"Run `make install`.*BASE="):
        patch.write(project, None, tmp_path / "x.patch")
    with pytest.raises(patch.PatchError, match="'nope' .* is not a commit"):
        patch.write(project, "nope", tmp_path / "x.patch")
    assert patch.write(project, "HEAD", tmp_path / "x.patch")["files"] == []  # an explicit base works


def test_make_patch_check_passes_on_a_fresh_clone(origin, tmp_path):
    if not WHEELS.is_dir():
        pytest.skip(f"{WHEELS} absent (verl_vendor/vendor.py fetch): the vendor check needs the pinned wheel")
    clone = tmp_path / "fresh"
    subprocess.run(["git", "clone", "-q", str(origin), str(clone)], check=True)
    (clone / "verl_vendor" / "wheels").symlink_to(WHEELS)  # git-ignored; spares a download
    make = ["make", "-C", str(clone), "PREPARED=1", f"PY={sys.executable}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    out = subprocess.run([*make, "install"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "tagged HEAD" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([*make, "patch-check"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 file(s)" in out.stdout and "empty patch" in out.stdout and "patch-check: passed" in out.stdout
    # an edit in the surface: the patch carries it and still applies
    (clone / "run.sh").write_text((clone / "run.sh").read_text() + "# mine\n")
    out = subprocess.run([*make, "patch-check"], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "M run.sh" in out.stdout and "applies cleanly" in out.stdout, out.stdout + out.stderr
