"""Every command written in README.md and docs/ works as written, and every relative link resolves.

From each fenced shell block (```bash, ```sh, ```shell) of those pages, each command line is split into
its simple commands (at `&&`, `||`, `;`, `|`; wrappers `env`, `unshare`, `time`, `do`, `then` skipped;
`ssh HOST 'CMD'` checked as CMD) and each is checked:
- `make TARGET`: TARGET is a rule (or a .PHONY name) of the Makefile;
- `./run.sh ...`: its `recipe=NAME` is a recipe file, and its Hydra overrides (key=value and +key=value
  words after run.sh; assignments before the command are its environment) compose with that recipe as
  run.sh composes it (tests/composed.py, with `+device=cpu` and dummy paths as tests/test_config.py);
- `python -m opd_patches.X`: X is a module or package of opd_patches/;
- a path under recipes/, opd_patches/, tests/, docs/, verl_vendor/ or requirements/ named on the line
  (alone or as a VAR=value) exists.
Relative markdown links [text](path) of those pages (and recipes/README.md) resolve to a file of the
checkout, and a #fragment to a heading of a markdown target. Commands in ```text blocks are output
examples and are not checked.
"""

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "bench").glob("*.md"))]
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```", re.M | re.S)
SHELL = ("bash", "sh", "shell")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`[^`\n]*`")
ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PATHISH = re.compile(r"^(recipes|opd_patches|tests|docs|verl_vendor|requirements)/[\w./+-]+\.(ya?ml|py|md|json|txt|toml)$")
OPERATORS = {"&&", "||", ";", "|", "&"}
WRAPPERS = {"do", "then", "else", "time", "exec", "!"}


def make_targets() -> set[str]:
    """Rule names and .PHONY names of the Makefile (pattern rules and variable assignments excluded)."""
    targets = set()
    for line in (REPO / "Makefile").read_text().splitlines():
        if line.startswith(("\t", "#", " ")) or ":" not in line:
            continue
        head, _, rest = line.partition(":")
        if rest.startswith("=") or any(c in head for c in "=?+$%"):
            continue  # `X := v`, `X ?= v`, `$(VENV)/.installed-%: ...`
        if head.strip() == ".PHONY":
            targets.update(rest.split())
        else:
            targets.update(head.split())
    return targets


def commands(text: str) -> list[str]:
    """Command lines of the page's shell blocks (comment lines dropped, continuation lines joined)."""
    out = []
    for lang, body in FENCE.findall(text):
        if lang not in SHELL:
            continue
        for line in re.sub(r"\\\n\s*", " ", body).splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line.strip())
    return out


def _words(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = []
    for w in lexer:  # split a trailing `;` off its word (`patched;`), as the shell does
        if w.endswith(";") and w != ";":
            words += [w[:-1], ";"]
        else:
            words.append(w)
    return words


def simple_commands(words: list[str]) -> list[list[str]]:
    """The simple commands of one line's words, wrappers and environment assignments removed."""
    out, current = [], []
    for w in [*words, ";"]:
        if w not in OPERATORS:
            current.append(w)
            continue
        while current:
            if ASSIGN.match(current[0]) or current[0] in WRAPPERS:
                current = current[1:]
            elif current[0] == "env":
                current = current[1:]
                while current and current[0] == "-u":
                    current = current[2:]
            elif current[0] == "unshare":
                current = current[1:]
                while current and current[0].startswith("-"):
                    current = current[1:]
            else:
                break
        if current and current[0] == "ssh" and len(current) >= 3:
            out += simple_commands(_words(current[-1]))  # ssh HOST 'CMD'
        elif current:
            out.append(current)
        current = []
    return out


def problems(line: str, targets: set[str], compose=None) -> list[str]:
    """What is wrong with one command line (empty: nothing)."""
    try:
        line_words = _words(line)
        parts = simple_commands(line_words)
    except ValueError as exc:
        return [f"{line!r}: not a shell command ({exc})"]
    found = []
    # A GPU-only line names its device as the launcher reads it (`DEVICE=gpu ./run.sh ...`); else the CPU's.
    device = next((w.split("=", 1)[1] for w in line_words if w.startswith("DEVICE=")), "cpu")
    for words in parts:
        for w in words:
            value = w.split("=", 1)[-1]
            if PATHISH.match(value) and not (REPO / value).exists():
                found.append(f"{line!r}: {value} does not exist")
        if words[0] == "make":
            for w in words[1:]:
                if not ASSIGN.match(w) and not w.startswith("-") and w not in targets:
                    found.append(f"{line!r}: no Makefile target {w!r}")
        elif words[0] == "./run.sh":
            recipe, overrides = "k1", []
            for w in words[1:]:
                if w.startswith("recipe="):
                    recipe = w.split("=", 1)[1]
                elif re.match(r"^\+{0,2}[\w.@/-]+=", w):
                    overrides.append(w)
                else:
                    found.append(f"{line!r}: {w!r} is no Hydra override (key=value)")
            if recipe == "base" or not (REPO / "recipes" / f"{recipe}.yaml").is_file():
                found.append(f"{line!r}: no recipe {recipe!r}")
            elif compose is not None:
                try:
                    compose(recipe, *overrides, device=device)
                except Exception as exc:  # noqa: BLE001  (Hydra's errors name the override)
                    found.append(f"{line!r}: does not compose: {str(exc).splitlines()[0]}")
        if "-m" in words[:-1]:
            mod = words[words.index("-m") + 1]
            if mod == "opd_patches" or mod.startswith("opd_patches."):
                base = REPO / Path(*mod.split("."))
                if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
                    found.append(f"{line!r}: no module {mod}")
    return found


def _compose(recipe, *overrides, device="cpu"):
    import composed

    return composed.compose_placeholder(recipe, *overrides, device=device)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M):
        s = slug(heading)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def link_problems(page: Path, text: str) -> list[str]:
    """Relative links of `text` (the page at `page`) that do not resolve."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    bad = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.name}: {target}: no file {path}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{page.name}: {target}: no heading #{fragment} in {path or page.name}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_commands_work_as_written(page):
    targets = make_targets()
    bad = [p for line in commands(page.read_text()) for p in problems(line, targets, _compose)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", [*PAGES, REPO / "recipes" / "README.md"], ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    bad = link_problems(page, page.read_text())
    assert not bad, "\n".join(bad)


def test_the_checks_catch_mistakes(tmp_path):
    targets = make_targets()
    assert {"smoke", "test", "test-fast", "learn", "eval", "study", "wheelhouse", "smoke-gpu"} <= targets
    assert not {"SHELL", "PROFILE", ".PHONY", "$(VENV)/.installed-%"} & targets
    text = ("```bash\n"
            "make smokee\n"
            "./run.sh recipe=nope\n"
            "STUDENT=x ./run.sh recipe=topk data.train_batch_sizee=3\n"
            "python -m opd_patches.nothing_here\n"
            "make study SPEC=recipes/studies/missing.yaml\n"
            "cd /tmp && make tset\n"
            "ssh host 'cd /data/opd && make instal PROFILE=gpu'\n"
            "env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null make wheelhous PROFILE=cpu\n"
            "```\n"
            "```text\nmake not-checked-here\n```\n")
    found = [p for line in commands(text) for p in problems(line, targets, _compose)]
    assert len(found) == 8, "\n".join(found)
    for good in ("EMBEDDED=1 ./run.sh recipe=topk +overlay=smoke data.train_batch_size=4",
                 "ssh cluster 'cd /data/opd && make install PROFILE=gpu WHEELHOUSE=/data/wh-gpu'",
                 "python -m opd_patches.eval --model M --suite embedded && make plot RUN=outputs/k1"):
        assert not problems(good, targets, _compose), good
    gpu_key = "actor_rollout_ref.rollout.engine_kwargs.vllm.compilation_config.mode=3"  # GPU profile only
    assert not problems(f"DEVICE=gpu ./run.sh recipe=topk {gpu_key}", targets, _compose)
    assert "does not compose" in problems(f"./run.sh recipe=topk {gpu_key}", targets, _compose)[0]
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# A heading: `with code`\n")
    bad = link_problems(page, "[a](missing.md) [b](there.md#a-heading-with-code) [c](there.md#nope) "
                              "[d](https://example.org) `[e](not-a-link.md)`")
    assert bad == ["page.md: missing.md: no file missing.md", "page.md: there.md#nope: no heading #nope in there.md"]
