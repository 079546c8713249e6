"""fsdp-train's step log as a Weights & Biases run, logged by wandb itself:

    python -m fsdpcpp.wandb PROJECT [--name NAME] [--config FLAGS.json]             # the JSON lines on stdin
    python -m fsdpcpp.wandb PROJECT [--name NAME] [--config FLAGS.json] LOG.jsonl   # a finished run's log

fsdp-train --wandb PROJECT starts the first form, named by the run's id, its config the flags the
run was given (LOG.config.json). W&B's own environment applies: WANDB_API_KEY (or `wandb login`),
WANDB_ENTITY, WANDB_MODE=offline (no account: `wandb sync` uploads later), WANDB_DIR.
"""
from __future__ import annotations

import argparse
import json
import sys

from ._step_metrics import steps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fsdpcpp.wandb", description=__doc__.split("\n\n")[0])
    p.add_argument("project")
    p.add_argument("log", nargs="?", help="a finished run's JSONL log (default: the lines on stdin)")
    p.add_argument("--name", help="the run's name in W&B")
    p.add_argument("--config", help="a JSON object recorded as the run's config (fsdp-train's LOG.config.json)")
    args = p.parse_args(argv)
    try:
        import wandb
    except ImportError as e:
        print(f"fsdpcpp.wandb: error: {e}: pip install wandb", file=sys.stderr)
        return 2
    config = None
    if args.config:
        with open(args.config) as f:
            config = json.load(f)
    run = wandb.init(project=args.project, name=args.name, config=config)
    for step, values in steps(open(args.log) if args.log else sys.stdin):
        run.log(values, step=step)
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
