"""A worker process of :class:`pyscf_ipu.optimize.WorkerOptimizers`: geomeTRIC's optimisers, stepped
on request over the socket whose descriptor is the one argument.

    python -m pyscf_ipu.optimizer_worker FD
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection

from pyscf_ipu.optimize import serve

if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
