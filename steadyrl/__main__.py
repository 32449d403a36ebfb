"""``python -m steadyrl`` and ``accelerate launch -m steadyrl``."""

import sys

from steadyrl.cli import main

sys.exit(main())
