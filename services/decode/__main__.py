import sys

from services.decode.server import main

sys.exit(main())
