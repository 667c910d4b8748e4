from opd_patches.bench.run import main

raise SystemExit(main())
