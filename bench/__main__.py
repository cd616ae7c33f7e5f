"""python -m bench: ckptool against cp + sync and the naive torch path (see bench/README.md)."""

import sys

from bench import main

sys.exit(main())
