import sys

from pdserve.prefill.server import main

sys.exit(main())
