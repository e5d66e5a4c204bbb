"""``python -m aiolm``: the ``aiolm`` command (serve, generate, chat, bench, proxy)."""

import sys

from aiolm.cli import main

sys.exit(main())
