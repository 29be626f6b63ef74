"""``python -m pdserve.gateway``: `pdserve gateway`."""

import sys

from pdserve.gateway.server import main

sys.exit(main())
