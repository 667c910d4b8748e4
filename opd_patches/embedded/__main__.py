"""`python -m opd_patches.embedded --out DIR [--task addition]`: build (or reuse) an embedded asset set.

No --task: the embedded default (random tiny student and teacher, opd_patches/embedded/build.py).
--task addition: the known-answer task (a teacher that knows it, a student that does not: addition.py).
"""

import argparse
from pathlib import Path

TASKS = ("default", "addition")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m opd_patches.embedded", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--task", choices=TASKS, default="default", help="which asset set (default: the embedded default)")
    args = ap.parse_args(argv)
    if args.task == "addition":
        from opd_patches.embedded.addition_build import build
    else:
        from opd_patches.embedded.build import build
    build(args.out)


if __name__ == "__main__":
    main()
