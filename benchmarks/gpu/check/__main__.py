"""`python -m benchmarks.gpu.check`: the GPU check (benchmarks/gpu/check/__init__.py)."""

import sys

from benchmarks.gpu.check.driver import main

sys.exit(main())
