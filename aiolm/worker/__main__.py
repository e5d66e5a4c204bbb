import sys

from aiolm.worker.worker import main

sys.exit(main())
