"""`python -m services.demo` (`make demo`)."""

from services.demo import main

raise SystemExit(main())
