"""``python -m steadyrl`` and ``accelerate launch -m steadyrl``."""

from steadyrl.cli import main

raise SystemExit(main())
