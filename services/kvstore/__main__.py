"""``python -m services.kvstore``: serve the KV block store."""

import sys

from services.kvstore.cli import main

sys.exit(main())
