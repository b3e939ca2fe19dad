"""`python -m devtools.demo` (`make demo`)."""

from devtools.demo import main

raise SystemExit(main())
