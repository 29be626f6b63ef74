import sys

from pdserve.decode.server import main

sys.exit(main())
