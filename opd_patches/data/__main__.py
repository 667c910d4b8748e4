"""`python -m opd_patches.data SRC [--out DIR] ...`: see `opd_patches.data.prepare`."""

from opd_patches.data.prepare import main

if __name__ == "__main__":
    raise SystemExit(main())
