"""``python -m pdserve.kvstore``: `pdserve kvstore`."""

import sys

from pdserve.kvstore.server import main

sys.exit(main())
