import sys

from opd_patches.study.cli import main

sys.exit(main())
