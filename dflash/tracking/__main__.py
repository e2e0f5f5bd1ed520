"""`python -m dflash.tracking reap [--uri URI] [--run RUN_ID ...]`: end runs left RUNNING by a hard kill."""

import sys

from dflash.tracking.store import main

sys.exit(main())
