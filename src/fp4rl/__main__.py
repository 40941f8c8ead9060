"""``python -m fp4rl``: the command line, as launchers such as ``torchrun -m fp4rl`` run it."""

import sys

from fp4rl.cli import main

sys.exit(main())
