"""Training-step memory by optimizer configuration (issue 41, item 4): a front-end to
``python -m trainops bench --memory`` (trainops.bench.memory, where the options are described).

    PYTHONPATH=src python benchmarks/bench_optim_memory.py --out benchmarks/results/optim-memory-h200.json
    PYTHONPATH=src python benchmarks/bench_optim_memory.py --cpu --out /tmp/x.json   # self-check, tiny
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from trainops.bench import memory  # noqa: E402

if __name__ == "__main__":
    sys.exit(memory.main(sys.argv[1:]))
