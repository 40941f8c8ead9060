"""``python -m fp4rl.cli``: the ``fp4rl`` command."""

import sys

from fp4rl.cli.app import main

sys.exit(main())
