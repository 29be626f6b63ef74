"""`python -m bench ...` is `pdserve bench ...`."""

import sys

from pdserve.loadgen.cli import main

sys.exit(main())
