"""`python -m bench ...` is `pdserve bench ...`."""

import sys

from bench.cli import main

sys.exit(main())
