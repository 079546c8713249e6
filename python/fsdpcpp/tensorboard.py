"""fsdp-train's step log as TensorBoard scalars, written by TensorBoard's own writer
(torch.utils.tensorboard.SummaryWriter):

    python -m fsdpcpp.tensorboard DIR            # the JSON lines on stdin (fsdp-train --tensorboard DIR)
    python -m fsdpcpp.tensorboard DIR LOG.jsonl  # a finished run's log
"""
from __future__ import annotations

import sys

from ._step_metrics import steps


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        print(f"fsdpcpp.tensorboard: error: {e}: pip install tensorboard", file=sys.stderr)
        return 2
    writer = SummaryWriter(argv[0])
    for step, values in steps(open(argv[1]) if len(argv) == 2 else sys.stdin):
        for tag, value in values.items():
            writer.add_scalar(tag, value, step)
        writer.flush()  # each step visible while the run goes on
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
