"""Resolve a dependency profile, stage it as a wheelhouse, install from it without network.

    python tools/wheelhouse.py resolve --profile gpu|cpu [--out pylock.gpu.toml]
    python tools/wheelhouse.py build --profile gpu|cpu --dir DIR [--torch-from DIR|URL]   # make wheelhouse
    python tools/wheelhouse.py install --profile gpu|cpu --dir DIR [--venv .venv]          # make install WHEELHOUSE=DIR

Stdlib only: the Makefile runs it as a script, before any environment exists (build/resolve need 3.11+).

- resolve: `uv pip compile requirements/<profile>.txt` for the profile's target with the settings of
  requirements/uv.toml (its `exclude-newer` date freezes the index, so a new release cannot change
  the answer). The gpu target is Linux x86_64 (manylinux_2_35, glibc >= 2.35), CPython 3.12; cpu is this interpreter.
  A real resolver, unlike a walk of dependencies: e.g. it picks the antlr4 runtime 4.9.3 that
  omegaconf's grammar needs although math-verify's latex2sympy2 allows 4.13.
- build: the resolution's wheels for the target, downloaded by pip from PyPI (sha256 checked against
  the resolution); a package published only as an sdist (antlr4-python3-runtime 4.9.3) is built here,
  and must give a pure-Python wheel. The cpu profile's torch is PyTorch's CPU build (2.13.0+cpu), not
  on PyPI: --torch-from names a folder holding it or an index; by default a folder in pip's configured
  find-links that holds the pinned wheel, else PyTorch's CPU index.
- install: a venv from the wheelhouse alone (`pip --no-index --find-links DIR`, pip's own settings
  ignored so a local wheel folder cannot fill a gap). Where the base interpreter already has the
  pinned torch (e.g. a GPU image's 2.11.0+cu130), the venv sees system site-packages and keeps it.
"""

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REQ = REPO / "requirements"
UV_CONFIG = REQ / "uv.toml"
CACHE = REPO / ".cache"
PROFILES = ("gpu", "cpu")
# The GPU hosts: x86_64 Linux with glibc >= 2.35 (Ubuntu 22.04+; llguidance ships 2_31 wheels only), CPython 3.12 (uv target, pip tag for the same).
GPU_TARGET = {"uv": ["--python-platform", "x86_64-manylinux_2_35", "--python-version", "3.12"],
              # pip does not widen manylinux_2_35 to the older glibc tags it includes: list them all
              "pip": [a for i in range(35, 4, -1) for a in ("--platform", f"manylinux_2_{i}_x86_64")]
              + ["--platform", "manylinux2014_x86_64", "--platform", "manylinux2010_x86_64",
                 "--platform", "manylinux1_x86_64", "--python-version", "3.12", "--implementation", "cp"]}
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
LOCK = "requirements.lock"
# pip settings that add sources or constraints: a wheelhouse is built from PyPI (+ the torch source)
# and installed from itself only. PIP_CERT / timeouts stay.
PIP_SOURCES = ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX", "PIP_REQUIREMENT")


def die(msg):
    sys.exit(f"wheelhouse: {msg}")


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def pin_of(profile, name):
    """The `name==X` pin of requirements/<profile>.txt (None if absent or not exact)."""
    for line in (REQ / f"{profile}.txt").read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*==\s*([^\s#;]+)", line)
        if m and norm(m[1]) == norm(name):
            return m[3]
    return None


def pip_env(base=None):
    env = dict(base or os.environ)
    for key in PIP_SOURCES:
        env.pop(key, None)
    env["PIP_CONFIG_FILE"] = os.devnull  # no pip.conf (user, site or global): no local wheel folders
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], **kw)


def find_uv():
    """uv: $UV, the running interpreter's bin (the dev venv pins it), PATH, else a tool venv with cpu.txt's pin."""
    for cand in (os.environ.get("UV"), Path(sys.executable).parent / "uv", REPO / ".venv/bin/uv", shutil.which("uv")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return str(cand)
    version = pin_of("cpu", "uv")
    tool = CACHE / f"uv-{version}"
    if not (tool / "bin/uv").exists():
        run([sys.executable, "-m", "venv", tool], check=True)
        if run([tool / "bin/python", "-m", "pip", "install", "-q", f"uv=={version}"], env=pip_env()).returncode:
            die(f"uv is needed to resolve (pinned uv=={version} in requirements/cpu.txt) and could not be "
                f"installed into {tool}: install it (`pip install uv=={version}`) or set UV=/path/to/uv")
    return str(tool / "bin/uv")


def torch_source(profile, torch_from):
    """Where the cpu profile's CPU torch comes from: an explicit folder/index, pip's find-links, PyTorch's index."""
    if profile != "cpu":
        return torch_from
    if torch_from:
        return torch_from
    version = pin_of("cpu", "torch")
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    links = re.findall(r"find-links='([^']*)'", out) + os.environ.get("PIP_FIND_LINKS", "").split()
    for link in (p for entry in links for p in entry.split()):
        folder = Path(link.removeprefix("file://"))
        if folder.is_dir() and list(folder.glob(f"torch-{version}+cpu-*.whl")):
            return str(folder)
    return TORCH_CPU_INDEX


def resolve(profile, out, torch_from=None):
    """Write the resolution of requirements/<profile>.txt as pylock.toml (out); return uv's exit status."""
    if not re.fullmatch(r"pylock\.[^.]+\.toml", Path(out).name):
        die(f"{out}: uv writes a pylock only to a file named pylock.<name>.toml")
    cmd = [find_uv(), "pip", "compile", REQ / f"{profile}.txt", "--config-file", UV_CONFIG,
           "--cache-dir", CACHE / "uv", "--python", sys.executable, "--no-header", "--quiet", "-o", out]
    if profile == "gpu":
        cmd += GPU_TARGET["uv"]
    else:
        src = torch_source(profile, torch_from)
        cmd += ["--torch-backend", "cpu"] if src == TORCH_CPU_INDEX else (
            ["--find-links", src] if Path(src).is_dir() else ["--index", src])
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}  # only uv.toml configures it
    return run(cmd, env=env).returncode


def read_pylock(path):
    import tomllib  # Python 3.11+
    return tomllib.loads(Path(path).read_text())["packages"]


def build(profile, folder, torch_from):
    if sys.version_info < (3, 11):
        die("building a wheelhouse needs Python 3.11+ (tomllib); the install from it does not")
    t0 = time.time()
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    pylock = folder / f"pylock.{profile}.toml"
    src = torch_source(profile, torch_from)
    if resolve(profile, pylock, src):
        die(f"requirements/{profile}.txt does not resolve for its target (uv's reason above)")
    packages = read_pylock(pylock)
    lock = [f"{p['name']}=={p['version']}" for p in packages]
    torchish = [r for r in lock if "+" in r]  # local builds (2.13.0+cpu) come from the torch source only
    if profile == "cpu" and not any(r.startswith("torch==") and "+cpu" in r for r in lock):
        die(f"the cpu profile resolved a torch that is not the CPU build; give --torch-from (TORCH_FROM=) a "
            f"folder holding torch-{pin_of('cpu', 'torch')}+cpu-*.whl or {TORCH_CPU_INDEX}")
    sdist_only = [f"{p['name']}=={p['version']}" for p in packages if not p.get("wheels")]
    wheels = [r for r in lock if r not in sdist_only and r not in torchish]
    target = GPU_TARGET["pip"] if profile == "gpu" else []
    pip = [sys.executable, "-m", "pip"]
    env = pip_env()

    def download(reqs, extra=()):
        if not reqs:
            return
        listing = folder / ".download.txt"
        listing.write_text("\n".join(reqs) + "\n")
        cmd = pip + ["download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off", *target, "-d", folder,
                     "-r", listing, *extra]
        if run(cmd, env=env).returncode:
            die(f"pip could not download every wheel of {listing} (reason above)")
        listing.unlink()

    download(wheels)
    if torchish:
        if not src:
            die(f"{', '.join(torchish)}: a local build in the resolution, but no --torch-from source")
        download(torchish, ["--find-links", src] if Path(src).is_dir() else ["--extra-index-url", src])
    for req in sdist_only:  # published as sdist only: built here, so it must be pure Python
        if run(pip + ["wheel", "--no-deps", "--progress-bar", "off", "-w", folder, req], env=env).returncode:
            die(f"could not build a wheel of {req}")
        name, version = req.split("==")
        built = [f.name for f in folder.glob("*.whl") if wheel_key(f.name) == (norm(name), version)]
        if profile == "gpu" and not all(b.endswith("-none-any.whl") for b in built):
            die(f"{req} has no wheel for the target and builds a platform wheel here ({built}): pin a version "
                f"with a manylinux wheel in requirements/gpu.txt")
    found = check_complete(folder, lock)
    verify_hashes(folder, packages)
    platform = "linux x86_64 manylinux_2_35, CPython 3.12" if profile == "gpu" else f"this machine, {sys.version.split()[0]}"
    (folder / LOCK).write_text(f"# wheelhouse profile={profile} target: {platform}; resolved with "
                               f"requirements/uv.toml ({exclude_newer()})\n" + "\n".join(lock) + "\n")
    (folder / "wheelhouse.json").write_text(json.dumps(
        {"profile": profile, "target": platform, "exclude_newer": exclude_newer(), "torch_from": src,
         "packages": len(lock), "built_from_sdist": sdist_only}, indent=1) + "\n")
    size = sum(f.stat().st_size for f in found)
    print(f"wheelhouse {folder}: {len(found)} wheels, {size / 2**20:.0f} MiB, profile {profile} ({platform}), "
          f"{len(sdist_only)} built from sdists ({', '.join(sdist_only) or 'none'}), {time.time() - t0:.0f} s")


def wheel_key(filename):
    name, version = filename.split("-")[:2]
    return norm(name), version


def check_complete(folder, lock):
    have = {wheel_key(f.name): f for f in folder.glob("*.whl")}
    missing = [r for r in lock if (norm(r.split("==")[0]), r.split("==")[1]) not in have]
    if missing:
        die(f"{folder}: no wheel for {', '.join(missing)}")
    return [have[(norm(r.split("==")[0]), r.split("==")[1])] for r in lock]


def verify_hashes(folder, packages):
    """A downloaded wheel listed in the resolution must have the sha256 it lists."""
    listed = {w["url"].rsplit("/", 1)[-1]: w["hashes"]["sha256"]
              for p in packages for w in p.get("wheels", []) if "url" in w and "sha256" in w.get("hashes", {})}
    for f in folder.glob("*.whl"):
        if f.name in listed and hashlib.sha256(f.read_bytes()).hexdigest() != listed[f.name]:
            die(f"{f}: sha256 differs from the resolution's; delete it and rebuild")


def exclude_newer():
    m = re.search(r'^exclude-newer\s*=\s*"([^"]+)"', UV_CONFIG.read_text(), re.M)
    if not m:
        die(f"{UV_CONFIG}: no exclude-newer = \"<date>\" line")
    return m[1]


def preinstalled_torch(python, pin):
    """The base interpreter's torch version when it satisfies the pin (2.11.0+cu130 satisfies 2.11.0)."""
    # its installed metadata, not `import torch` (seconds): what pip compares with the pin too
    got = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                         capture_output=True, text=True)
    version = got.stdout.strip()
    if got.returncode or not version:
        return None
    same = version == pin or ("+" not in pin and version.split("+")[0] == pin)
    return version if same else None


def install(profile, folder, venv):
    t0 = time.time()
    folder, venv = Path(folder).resolve(), Path(venv)
    lock = folder / LOCK
    if not lock.is_file():
        die(f"{lock} is missing: build the wheelhouse first (`make wheelhouse PROFILE={profile} DIR={folder}`)")
    header = lock.read_text().splitlines()[0]
    if f"profile={profile} " not in header:
        die(f"{folder} is not a {profile} wheelhouse ({header}); pass PROFILE= to match it")
    reqs = [line for line in lock.read_text().splitlines() if line and not line.startswith("#")]
    torch_pin = next(r.split("==")[1] for r in reqs if r.startswith("torch=="))
    if not (venv / "bin/python").exists():
        reuse = preinstalled_torch(sys.executable, torch_pin)
        print(f"torch: reusing {sys.executable}'s torch {reuse}" if reuse else "torch: from the wheelhouse")
        run([sys.executable, "-m", "venv", *(["--system-site-packages"] if reuse else []), venv], check=True)
    py, env = venv / "bin/python", pip_env()
    offline = ["--no-index", "--find-links", folder]
    steps = [[py, "-m", "pip", "install", "-q", *offline, "-r", lock],
             [py, "-m", "pip", "install", "-q", *offline, "--no-deps", "-e", REPO],
             [py, REPO / "verl_vendor/vendor.py", "check", "--wheel-dir", folder]]
    for cmd in steps:
        if run(cmd, env=env).returncode:
            die(f"offline install from {folder} failed at: {' '.join(map(str, cmd))}")
    print(f"installed {len(reqs)} packages from {folder} into {venv} without network, {time.time() - t0:.0f} s")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("resolve", "build", "install"):
        p = sub.add_parser(name)
        p.add_argument("--profile", required=True, choices=PROFILES)
        if name == "resolve":
            p.add_argument("--out", help="pylock.<name>.toml to write (default: .cache/pylock.<profile>.toml)")
        else:
            p.add_argument("--dir", required=True, help="the wheelhouse folder")
        if name != "install":
            p.add_argument("--torch-from", help="cpu profile: a folder holding the CPU torch wheel, or an index URL")
        else:
            p.add_argument("--venv", default=str(REPO / ".venv"))
    a = ap.parse_args()
    if a.command == "resolve":
        CACHE.mkdir(exist_ok=True)
        sys.exit(resolve(a.profile, a.out or CACHE / f"pylock.{a.profile}.toml", a.torch_from))
    if a.command == "build":
        build(a.profile, a.dir, a.torch_from)
    else:
        install(a.profile, a.dir, a.venv)


if __name__ == "__main__":
    main()
