"""`python -m opd_patches.eval`: see `opd_patches.eval.cli`."""

from opd_patches.eval.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
