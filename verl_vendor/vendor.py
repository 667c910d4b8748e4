#!/usr/bin/env python3
"""Pin, fetch and verify the upstream VERL release that opd_patches builds on.

    vendor.py fetch         download the pinned wheel into verl_vendor/wheels/ and verify its sha256
    vendor.py materialize   unpack the wheel's verl/ tree into verl_vendor/upstream/ for reading and diffing
    vendor.py check         prove the installed verl package is byte-identical to the pinned wheel

Stdlib only, so it runs before (or without) the project's environment.
"""

import argparse
import base64
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def load_pin(path=HERE / "pin.toml"):
    # pin.toml is flat `key = "value"` lines; parsed by hand because tomllib needs Python 3.11.
    pin = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r'(\w+)\s*=\s*"([^"]*)"', line)
        if not m:
            sys.exit(f"vendor.py: {path}:{n}: expected `key = \"value\"`, got: {line}")
        pin[m[1]] = m[2]
    missing = {"name", "version", "wheel", "sha256"} - pin.keys()
    if missing:
        sys.exit(f"vendor.py: {path}: missing keys: {', '.join(sorted(missing))}")
    return pin


PIN = load_pin()
REINSTALL = f"`make install` or `pip install --force-reinstall --no-deps {PIN['name']}=={PIN['version']}`"


def fetch(wheel_dir):
    """Return the path of the pinned wheel, downloading it if absent; exit unless its sha256 matches the pin."""
    wheel = wheel_dir / PIN["wheel"]
    if not wheel.exists():
        # --only-binary: an sdist would be built locally and could never match the pinned hash.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               f"{PIN['name']}=={PIN['version']}", "-d", str(wheel_dir)]
        if subprocess.run(cmd).returncode != 0 or not wheel.exists():
            sys.exit(f"vendor.py: could not download {PIN['wheel']} (no network?). Run this where PyPI is "
                     f"reachable, or copy the wheel into {wheel_dir}/:\n  {' '.join(cmd)}")
    actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if actual != PIN["sha256"]:
        sys.exit(f"vendor.py: sha256 mismatch for {wheel}\n  expected {PIN['sha256']} (pin.toml)\n"
                 f"  actual   {actual}\nDelete the file and rerun `vendor.py fetch`; if PyPI really serves "
                 f"different bytes for this version, stop and investigate before changing the pin.")
    return wheel


def materialize(wheel, dest):
    """Replace dest/verl/ with the wheel's verl/ tree (replacing, not merging, keeps reruns idempotent)."""
    target = dest / PIN["name"]
    shutil.rmtree(target, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.namelist() if m.startswith(f"{PIN['name']}/")]
        zf.extractall(dest, members)
    for path in target.rglob("*"):
        if path.is_file():
            path.chmod(0o444)  # a reference copy: edits belong in opd_patches, never here
    print(f"{PIN['name']} {PIN['version']}: {len(members)} files unpacked into {target}")


def record_hashes(wheel):
    """{relative path: RECORD hash} for the package's files, read from the verified wheel.

    The installed dist-info RECORD is not trusted: it can be edited together with the files it describes.
    """
    record = f"{PIN['name']}-{PIN['version']}.dist-info/RECORD"
    with zipfile.ZipFile(wheel) as zf:
        rows = csv.reader(io.TextIOWrapper(zf.open(record), encoding="utf-8"))
        return {path: digest for path, digest, *_ in rows if path.startswith(f"{PIN['name']}/")}


def record_digest(path):
    # RECORD format: "sha256=" + urlsafe base64 of the digest, without "=" padding.
    digest = hashlib.sha256(path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def check(wheel, site_packages):
    name, version = PIN["name"], PIN["version"]
    if site_packages is None:
        # find_spec on a top-level name locates the package without executing it (importing verl is slow).
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            sys.exit(f"vendor.py: {name} is not installed for {sys.executable}; install it with {REINSTALL}")
        root, search_path = Path(spec.origin).parent, sys.path
    else:
        root, search_path = site_packages / name, [str(site_packages)]
        if not root.is_dir():
            sys.exit(f"vendor.py: no {name}/ package in {site_packages}")

    problems = []
    versions = [d.version for d in importlib.metadata.distributions(name=name, path=search_path)]
    if versions != [version]:
        problems.append(("VERSION", f"{name} dist-info", f"found versions {versions or 'none'}, pinned {version}"))

    expected = record_hashes(wheel)
    for rel, digest in sorted(expected.items()):
        path = root.parent / rel
        if not path.is_file():
            problems.append(("MISSING", rel, f"reinstall: {REINSTALL}"))
        elif record_digest(path) != digest:
            problems.append(("MODIFIED", rel, f"upstream must stay unchanged; move the change into opd_patches, "
                                              f"then reinstall: {REINSTALL}"))
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for fname in sorted(filenames):
            rel = (Path(dirpath) / fname).relative_to(root.parent).as_posix()
            if not fname.endswith(".pyc") and rel not in expected:
                # pip's reinstall only removes files listed in RECORD, so extras must be deleted by hand.
                problems.append(("EXTRA", rel, "not in the upstream wheel; delete it (a reinstall leaves it)"))

    if problems:
        print(f"{name} {version} at {root}: {len(problems)} problem(s) against {wheel.name}:", file=sys.stderr)
        for kind, rel, hint in problems:
            print(f"  {kind:8} {rel}  -- {hint}", file=sys.stderr)
        sys.exit(1)
    print(f"{name} {version}: {len(expected)} files verified against {wheel.name} sha256 {PIN['sha256']}")


def main():
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--wheel-dir", type=Path, default=HERE / "wheels",
                        help="where the pinned wheel is kept (default: %(default)s)")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", parents=[common], help="download and verify the pinned wheel")
    p = sub.add_parser("materialize", parents=[common], help="unpack the wheel's verl/ tree for reading")
    p.add_argument("--dest", type=Path, default=HERE / "upstream", help="default: %(default)s")
    p = sub.add_parser("check", parents=[common], help="verify the installed verl against the wheel")
    p.add_argument("--site-packages", type=Path, help="directory containing verl/ (default: where Python finds it)")
    args = parser.parse_args()

    wheel = fetch(args.wheel_dir)
    if args.command == "fetch":
        print(f"{wheel}: sha256 {PIN['sha256']} OK")
    elif args.command == "materialize":
        materialize(wheel, args.dest)
    else:
        check(wheel, args.site_packages)


if __name__ == "__main__":
    main()
