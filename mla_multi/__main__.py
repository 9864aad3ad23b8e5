from mla_multi.cli import main

raise SystemExit(main())
