"""``python -m services.kvstore``: `pdserve kvstore`."""

import sys

from services.kvstore.server import main

sys.exit(main())
