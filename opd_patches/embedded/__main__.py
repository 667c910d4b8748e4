"""Allow ``python -m opd_patches.embedded --out DIR``."""

from opd_patches.embedded.build import main

if __name__ == "__main__":
    main()
