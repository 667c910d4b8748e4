"""The submission patch: the editable surface's diff against the commit the user started from.

    python -m tools.patch record-base              # `make install`: tag opd-base at HEAD, once
    python -m tools.patch write [--base REF] [--out opd.patch]          # `make patch`
    python -m tools.patch check [--base REF] [--patch opd.patch]        # `make patch-check`

Stdlib only: the Makefile runs it as a script (`python tools/patch.py ...`), without
importing opd_patches (and so verl).

Conventions:
- Editable surface: SURFACE below (opd_patches, recipes, run.sh, Makefile, README.md, docs, tests, tools). Changes
  elsewhere are listed as "not in the patch"; a patch touching verl_vendor/ or anything outside the
  surface is refused by `check`.
- Base: `--base REF` (make: BASE=...), else, for `check`, the base commit written in the patch's
  header, else the tag `opd-base`. `make install` creates that tag at HEAD when it is absent (a
  lightweight tag: local, survives later commits, never moved; `git tag -f opd-base <commit>` moves it).
  A tag rather than a file keeps the working tree clean and works in any fresh clone.
- The patch is `git diff --binary` of the working tree against the base, untracked files included
  (ignored ones excluded), built in a temporary index (GIT_INDEX_FILE): the user's index is untouched.
  It starts with `# opd-patch ...` comment lines, which `git apply` and `patch` skip.
- `check` clones the repository into a temporary folder, checks out the base, runs `git apply --check`
  and then applies the patch, and runs `verl_vendor/vendor.py check` from that clean checkout (the
  installed verl is byte-identical to the pinned wheel). Exit 0: passes; 1: refused or failed; 2: usage.
"""

import argparse
import codecs
import datetime
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SURFACE = ("opd_patches", "recipes", "run.sh", "Makefile", "README.md", "docs", "tests", "tools")
FORBIDDEN = ("verl_vendor",)
BASE_TAG = "opd-base"
HEADER = "# opd-patch"
REPO = Path(__file__).resolve().parents[1]


class PatchError(RuntimeError):
    """A patch cannot be written or checked; the message says what to do."""


def git(repo: Path, *args, env=None, text=True, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=text, env=env)
    if check and proc.returncode != 0:
        err = proc.stderr if text else proc.stderr.decode(errors="replace")
        raise PatchError(f"git {' '.join(args)} failed in {repo}: {err.strip()}")
    return proc


def repo_root(path: Path) -> Path:
    proc = git(path, "rev-parse", "--show-toplevel", check=False)
    if proc.returncode != 0:
        raise PatchError(f"{path} is not a git repository: the patch is a git diff; work in a clone of the project.")
    return Path(proc.stdout.strip())


def _commit(repo: Path, ref: str) -> str | None:
    proc = git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
    return proc.stdout.strip() or None


def in_surface(path: str) -> bool:
    return any(path == s or path.startswith(s + "/") for s in SURFACE)


def record_base(repo: Path) -> str:
    """Tag HEAD as opd-base unless the tag exists; returns a one-line report."""
    existing = _commit(repo, f"refs/tags/{BASE_TAG}")
    if existing:
        return f"patch base: tag {BASE_TAG} already at {existing[:12]} (kept; `git tag -f {BASE_TAG} <commit>` moves it)"
    head = _commit(repo, "HEAD")
    if head is None:
        return f"patch base: {repo} has no commit yet; `make install` records it once one exists"
    git(repo, "tag", BASE_TAG, head)
    return f"patch base: tagged HEAD {head[:12]} as {BASE_TAG} (make patch diffs against it)"


def resolve_base(repo: Path, base: str | None, header_base: str | None = None) -> tuple[str, str]:
    """(commit, how it was chosen) for --base, else the patch header's base, else the opd-base tag."""
    for ref, label in ((base, f"--base {base}"), (header_base, "the patch header"), (BASE_TAG, f"tag {BASE_TAG}")):
        if ref:
            sha = _commit(repo, ref)
            if sha:
                return sha, label
            if ref != BASE_TAG:
                raise PatchError(f"base {ref!r} ({label}) is not a commit of {repo}: pass BASE=<commit or tag>.")
    raise PatchError(
        f"no base recorded: tag {BASE_TAG} is absent. Run `make install` (it tags the commit you start from) or "
        f"pass BASE=<the commit you started from> (e.g. `make patch BASE=origin/main`)."
    )


def _existing_surface(repo: Path, sha: str) -> list[str]:
    in_base = set(git(repo, "ls-tree", "--name-only", sha, "--", *SURFACE).stdout.split())
    return [p for p in SURFACE if (repo / p).exists() or p in in_base]


def build(repo: Path, sha: str) -> tuple[bytes, list[tuple[str, str]]]:
    """(diff bytes, [(status A/M/D, path)]) of the surface's working tree against commit sha."""
    paths = _existing_surface(repo, sha)
    if not paths:
        return b"", []
    with tempfile.TemporaryDirectory(prefix="opd-patch-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git(repo, "read-tree", sha, env=env)
        git(repo, "add", "--all", "--", *paths, env=env)
        # Fixed prefixes and no renames: independent of the user's diff.* settings, applies everywhere.
        opts = ["--cached", "--no-renames", "--no-color", "--no-ext-diff", "--src-prefix=a/", "--dst-prefix=b/"]
        diff = git(repo, "diff", *opts, "--binary", sha, "--", *paths, env=env, text=False).stdout
        names = git(repo, "diff", *opts, "--name-status", "-z", sha, "--", *paths, env=env).stdout
    fields = names.split("\0")
    return diff, [(fields[i], fields[i + 1]) for i in range(0, len(fields) - 1, 2)]


def outside_changes(repo: Path, sha: str, skip=()) -> list[str]:
    """Paths that differ from the base (tracked or untracked, not ignored) outside the surface."""
    tracked = git(repo, "diff", "--name-only", "--no-renames", "-z", sha).stdout.split("\0")
    untracked = git(repo, "ls-files", "--others", "--exclude-standard", "-z").stdout.split("\0")
    return sorted({p for p in tracked + untracked if p and not in_surface(p) and p not in skip})


def write(repo: Path, base: str | None, out: Path) -> dict:
    repo = repo_root(repo)
    sha, label = resolve_base(repo, base)
    diff, files = build(repo, sha)
    counts = {k: sum(1 for s, _ in files if s == k) for k in ("A", "M", "D")}
    header = (
        f"{HEADER} base={sha} ({label})\n"
        f"# surface: {' '.join(SURFACE)}\n"
        f"# files: {len(files)} ({counts['A']} added, {counts['M']} modified, {counts['D']} deleted); "
        f"written {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(header.encode() + diff)
    rel_out = os.path.relpath(out.resolve(), repo)
    return {"out": str(out), "base": sha, "base_from": label, "bytes": out.stat().st_size, "diff_bytes": len(diff),
            "files": files, "outside": outside_changes(repo, sha, skip={rel_out})}


def header_base(patch: bytes) -> str | None:
    for line in patch.decode(errors="replace").splitlines():
        if line.startswith(HEADER + " base="):
            return line.split("base=", 1)[1].split()[0]
        if line.startswith("diff --git"):
            break
    return None


def _unquote(name: str) -> str:
    # git C-quotes paths with special characters: "a/x\ty", non-ASCII as octal byte escapes.
    if len(name) >= 2 and name[0] == name[-1] == '"':
        return codecs.escape_decode(name[1:-1].encode())[0].decode("utf-8", "replace")
    return name


def _strip_side(name: str) -> str | None:
    name = _unquote(name.strip())
    return None if name == "/dev/null" else name.split("/", 1)[1] if name[:2] in ("a/", "b/") else name


def touched(patch: bytes) -> list[str]:
    """Every path the patch touches, both sides of renames and copies included (git apply --numstat
    names only the new side of a rename, which would let a rename out of verl_vendor/ through)."""
    paths, header = set(), False  # header: between "diff --git" and the first hunk, where ---/+++ name files
    for line in patch.decode("utf-8", "replace").splitlines():
        if line.startswith(("@@", "GIT binary patch")):
            header = False
        elif line.startswith("diff --git "):
            header = True
            rest = line[len("diff --git "):]
            tokens = re.findall(r'"(?:[^"\\]|\\.)*"|\S+', rest)
            half = (len(rest) - 5) // 2  # unquoted "a/X b/X" (the same X: not a rename)
            if rest == f"a/{rest[2:2 + half]} b/{rest[2:2 + half]}":
                paths.add(rest[2:2 + half])
            elif len(tokens) == 2:
                paths.update(filter(None, map(_strip_side, tokens)))
        elif line.startswith(("rename from ", "rename to ", "copy from ", "copy to ")):
            paths.add(_unquote(line.split(" ", 2)[2]))
        elif header and line.startswith(("--- ", "+++ ")):
            side = _strip_side(line[4:].split("\t")[0])
            if side:
                paths.add(side)
    return sorted(paths)


def check(repo: Path, patch: Path, base: str | None, wheel_dir: Path | None) -> list[str]:
    """Run every check; returns the lines to print. Raises PatchError on the first failure."""
    repo = repo_root(repo)
    if not patch.is_file():
        raise PatchError(f"{patch}: no such patch file; write it with `make patch`.")
    patch = patch.resolve()  # git runs with -C: relative paths would resolve against the repository
    data = patch.read_bytes()
    sha, label = resolve_base(repo, base, header_base(data))
    has_diff = b"\ndiff --git " in b"\n" + data
    paths = touched(data)
    forbidden = [p for p in paths if any(p == f or p.startswith(f + "/") for f in FORBIDDEN)]
    if forbidden:
        raise PatchError(f"{patch} touches {', '.join(forbidden)}: upstream VERL and its pin stay unchanged; "
                         "move the change into opd_patches/ (see docs/architecture.md, 'How VERL is extended').")
    outside = [p for p in paths if not in_surface(p)]
    if outside:
        raise PatchError(f"{patch} touches files outside the editable surface ({' '.join(SURFACE)}): "
                         f"{', '.join(outside)}.")
    report = [f"{patch}: {len(data)} bytes, {len(paths)} file(s), base {sha[:12]} ({label})"]
    wheel_dir = wheel_dir or repo / "verl_vendor" / "wheels"
    with tempfile.TemporaryDirectory(prefix="opd-patch-check-") as tmp:
        clean = Path(tmp) / "clean"
        # --shared borrows the objects (no copy); the base may be any commit of this repository.
        subprocess.run(["git", "clone", "--quiet", "--shared", "--no-checkout", str(repo), str(clean)],
                       check=True, capture_output=True)
        git(clean, "checkout", "--quiet", "--detach", sha)
        if has_diff:
            git(clean, "apply", "--check", str(patch.resolve()))
            git(clean, "apply", str(patch.resolve()))
            report.append(f"git apply --check: applies cleanly to a clean checkout of {sha[:12]}")
        else:
            report.append("empty patch (nothing differs from the base): nothing to apply")
        vendor = clean / "verl_vendor" / "vendor.py"
        if not vendor.is_file():
            raise PatchError(f"the base {sha[:12]} has no verl_vendor/vendor.py: is it a commit of this project?")
        proc = subprocess.run([sys.executable, str(vendor), "check", "--wheel-dir", str(wheel_dir)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise PatchError(f"vendor check failed (installed verl differs from the pinned wheel):\n{proc.stderr.strip()}")
        report.append(f"vendor check: {proc.stdout.strip()}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=REPO, help="the project's git checkout (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("record-base", help=f"tag HEAD as {BASE_TAG} unless the tag exists")
    p = sub.add_parser("write", help="write the patch")
    p.add_argument("--base", help=f"base ref (default: tag {BASE_TAG})")
    p.add_argument("--out", type=Path, default=Path("opd.patch"))
    p = sub.add_parser("check", help="prove the patch applies to a clean checkout of its base; vendor check")
    p.add_argument("--base", help=f"base ref (default: the patch header's, else tag {BASE_TAG})")
    p.add_argument("--patch", type=Path, default=Path("opd.patch"))
    p.add_argument("--wheel-dir", type=Path, help="pinned verl wheel folder (default: <repo>/verl_vendor/wheels)")
    args = parser.parse_args(argv)
    try:
        if args.command == "record-base":
            if git(args.repo, "rev-parse", "--git-dir", check=False).returncode != 0:
                print(f"patch base: {args.repo} is not a git repository; `make patch` will need BASE=... in a clone")
                return 0
            print(record_base(repo_root(args.repo)))
        elif args.command == "write":
            r = write(args.repo, args.base, args.out)
            print(f"{r['out']}: {r['bytes']} bytes, {len(r['files'])} file(s) against {r['base'][:12]} ({r['base_from']})")
            for status, path in r["files"]:
                print(f"  {status} {path}")
            if not r["files"]:
                print(f"  empty: nothing in the surface differs from the base. If you committed your work, pass "
                      f"BASE=<the commit you started from>.")
            if r["outside"]:
                print(f"not in the patch (outside the editable surface {' '.join(SURFACE)}):\n  " + "\n  ".join(r["outside"]))
        else:
            print("\n".join(check(args.repo, args.patch, args.base, args.wheel_dir)))
            print("patch-check: passed")
    except PatchError as exc:
        print(f"patch {args.command}: {exc}", file=sys.stderr)
        return 1 if args.command == "check" else 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
