import sys

from services.prefill.server import main

sys.exit(main())
