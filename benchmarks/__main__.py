"""`python -m benchmarks run ...`: the suite; `python -m benchmarks checkpoint ...`: the
checkpoint workloads (torch.save, DCP, safetensors, restores); `python -m benchmarks
outage ...`: a training loop's stall with S3 healthy and in a black hole; `python -m
benchmarks multinode ...`: one DCP checkpoint saved by several nodes, restored by others;
`python -m benchmarks soak --hours H`: checkpoints, retention, restores and faults for hours."""

import sys

if sys.argv[1:2] == ["checkpoint"]:
    from benchmarks.checkpoint import main

    sys.exit(main(sys.argv[2:]))

if sys.argv[1:2] == ["outage"]:
    from benchmarks.outage import main

    sys.exit(main(sys.argv[2:]))

if sys.argv[1:2] == ["multinode"]:
    from benchmarks.multinode import main

    sys.exit(main(sys.argv[2:]))

if sys.argv[1:2] == ["soak"]:
    from benchmarks.soak import main

    sys.exit(main(sys.argv[2:]))

from benchmarks.suite import main

sys.exit(main())
