"""A follower rank of a tensor-parallel engine: ``python -m pdserve.engine.tp_follower``
(started by rank 0, see ``pdserve.engine.tensor_parallel``)."""

import sys

from pdserve.engine.tensor_parallel import main

if __name__ == "__main__":
    sys.exit(main())
