from tools.bench.run import main

raise SystemExit(main())
