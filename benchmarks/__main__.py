"""`python -m benchmarks run ...`: the suite; `python -m benchmarks checkpoint ...`: the
checkpoint workloads (torch.save, DCP, safetensors, restores)."""

import sys

if sys.argv[1:2] == ["checkpoint"]:
    from benchmarks.checkpoint import main

    sys.exit(main(sys.argv[2:]))

from benchmarks.suite import main

sys.exit(main())
