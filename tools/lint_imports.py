"""The import map's rules (`make lint`, .ci/run): every `import` of the project's own modules, lazy ones
included, read from the source tree.

- no circle among opd_patches' modules (a package's `__init__` counts as the package);
- nothing in opd_patches imports tools/ (what only people run stays out of the runtime);
- the training side (everything a Ray worker or the launcher loads: see TRAINING) imports neither the
  evaluation, nor studies, nor the data preparation: those run beside training, never inside it.

    python3 tools/lint_imports.py          # exit 1 naming each broken rule's import and line
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "opd_patches"
TRAINING = ("main", "registered", "trainers", "teacher", "losses", "patches", "platforms", "rollout",
            "attention", "ops", "hooks", "checks", "task")
NOT_FROM_TRAINING = ("eval", "study", "data")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int]]:
    """(imported project module, line) for every import in `path`; `from a import b` names a.b where a.b
    is a module, else a."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((full if full in known else base, node.lineno))
    return [(m, line) for m, line in found if m.split(".")[0] in (PACKAGE, "tools")]


def main() -> int:
    files = sorted((REPO / PACKAGE).rglob("*.py"))
    names = {module_name(f): f for f in files}
    known = set(names) | {module_name(f) for f in (REPO / "tools").rglob("*.py")}
    graph, errors = {}, []
    for name, path in names.items():
        graph[name] = set()
        for target, line in imports(path, name, known):
            where = f"{path.relative_to(REPO)}:{line}"
            if target.split(".")[0] == "tools":
                errors.append(f"{where}: imports {target}: the runtime package never imports tools/")
                continue
            while target not in names and "." in target:  # `import a.b.c` of an attribute: its module
                target = target.rpartition(".")[0]
            if target == name or target == PACKAGE or name.startswith(target + "."):
                continue  # the package itself (register(), VERL_VERSION) and a module's own parents
            graph[name].add(target)
            sub = name.split(".")[1] if "." in name else ""
            dest = target.split(".")[1] if "." in target else ""
            if sub in TRAINING and dest in NOT_FROM_TRAINING:
                errors.append(f"{where}: {name} imports {target}: the training side does not import {dest}/")
    # circles: depth-first search for a back edge
    state, stack = {}, []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                errors.append("import circle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt in graph and not state.get(nxt):
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if not state.get(node):
            visit(node)
    for line in errors:
        print(line)
    print(f"[lint_imports] {len(graph)} modules, {sum(map(len, graph.values()))} imports: "
          f"{'ok' if not errors else f'{len(errors)} problem(s)'}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
