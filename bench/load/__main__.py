"""`python -m bench.load`: see `bench.load.command`."""

from bench.load.command import main

raise SystemExit(main())
