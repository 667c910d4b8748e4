"""History lint: the code's comments and docstrings say why, never when or where (style rule 11).

Checks the comments and docstrings of opd_patches/**/*.py and tools/**/*.py (COMMENT tokens from `tokenize`; docstrings,
the first string statement of a module, class or function, from `ast`) and the `#` comments of
recipes/**/*.yaml for what belongs in docs/ beside its JSON, not in the code:
  machine   accelerator or host names (H100, 2-core, 16 cores, sandbox)
  date      2026-12-04, December 2026
  commit    a 7-40 digit hex token with digits and letters a-f
  issue     issue 13, issues #4
  path      paths outside the repository (../shared, /work/, the shared notes/)
  figure    a measured figure: a number with a time unit, an "Nx faster/slower" ratio, "measured"/"took" by a number
A comment `# lint: allow-figure (reason)` lets its line keep a figure that is a definition (a constant's
value, an example of output), not a measurement; on a docstring's closing line it covers that docstring.
Also every line of opd_patches' code and data files (`outside`): no path to a folder beside the checkout.
Prints `path:line: pattern: text` per hit and exits 1, or one line and exits 0 when all is clean.
Run from anywhere: python3 tools/lint_history.py (make lint; .ci/run runs it before the tests).
"""
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
         r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
PATTERNS = {
    "machine": re.compile(r"\b[HAB][12]00\b|\b\d+-core\b|\b\d+ (?:host )?cores\b|\bsandbox", re.I),
    "date": re.compile(rf"\b20\d\d-\d\d-\d\d\b|\b{MONTH}\.? (?:\d{{1,2}},? )?20\d\d\b"),
    # Hex runs inside longer words, paths or numbers (0x.., sha256:.., 1e-5) are not commits.
    "commit": re.compile(r"(?<![\w./:-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w/-])"),
    "issue": re.compile(r"\bissues? #?\d+|\bPR #?\d+", re.I),
    # notes/ is the shared notes folder beside the checkout, not a folder of the repository.
    "path": re.compile(r"\.\./shared|(?<![\w.])/work/|(?<![\w./-])notes/"),
    "figure": re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|s|min|seconds?|minutes?|h|hours?)\b|\b\d+m\d+s\b|~\d+ ?m\b"
                         r"|\b\d+(?:\.\d+)?\s?[x×] (?:faster|slower)\b"
                         r"|\b(?:measured|took)\b\W+(?:\w+\W+){0,2}?~?\d"),
}
ESCAPE = "lint: allow-figure ("
OUTSIDE = re.compile(r"\.\./shared\b|parents?(\[\d+\])?\s*/\s*[\"']shared[\"']")


def python_texts(path):
    """(line, text, escaped) of each comment and of each docstring line of one Python file."""
    source = path.read_text()
    lines = source.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string, ESCAPE in tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                escaped = ESCAPE in lines[first.end_lineno - 1]
                for n in range(first.lineno, first.end_lineno + 1):
                    yield n, lines[n - 1], escaped


def yaml_texts(path):
    """(line, text, escaped) of each `#` comment of one YAML file (a `#` inside quotes is not one)."""
    for n, line in enumerate(path.read_text().splitlines(), 1):
        quote = None
        for i, ch in enumerate(line):
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"" and (i == 0 or line[i - 1] in " [{:,-"):
                quote = ch
            elif ch == "#" and (i == 0 or line[i - 1].isspace()):
                yield n, line[i:], ESCAPE in line[i:]
                break


def hits(path, texts):
    for n, text, escaped in texts:
        for name, pattern in PATTERNS.items():
            if pattern.search(text) and not (name == "figure" and escaped):
                yield f"{path.relative_to(ROOT)}:{n}: {name}: {text.strip()}"


def main():
    # This file names the patterns it looks for, so it is the one file left out.
    files = [(p, python_texts) for folder in ("opd_patches", "tools") for p in sorted((ROOT / folder).rglob("*.py"))
             if p != Path(__file__).resolve()]
    files += [(p, yaml_texts) for p in sorted((ROOT / "recipes").rglob("*.yaml"))]
    found = [h for path, texts in files for h in hits(path, texts(path))]
    # Product code never reads a folder beside the checkout: a user's machine has none.
    found += [f"{p.relative_to(ROOT)}:{n}: outside: {line.strip()}" for p in sorted((ROOT / "opd_patches").rglob("*"))
              if p.suffix in (".py", ".yaml", ".yml", ".sh", ".txt") and p.is_file()
              for n, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    if found:
        print("\n".join(found))
        print(f"history lint: {len(found)} hits; comments say why, figures live in docs/ (style rule 11)")
        return 1
    print(f"history lint: {len(files)} files clean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
