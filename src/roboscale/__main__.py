from roboscale.cli import main

raise SystemExit(main())
