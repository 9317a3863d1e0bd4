"""`python -m megazero.train --config FILE [--section.key value ...]` (under torchrun for N processes)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional

from megazero.config import ConfigError, build_config, load_yaml, validate


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="megazero-train", description=__doc__,
                                     epilog="Any config key can be overridden: --model.num_layers 4 --zero.stage=2")
    parser.add_argument("--config", help="YAML config file (configs/gpt2-tiny.yaml, ...)")
    args, overrides = parser.parse_known_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        cfg = build_config(load_yaml(args.config) if args.config else {}, overrides)
        # Validate before any process group exists: a bad layout fails fast on every rank.
        validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
            raise ConfigError("logging.wandb is true but wandb is not installed; "
                              "pip install -e '.[wandb]' or pass --logging.wandb false")
    except ConfigError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    import torch.distributed as dist

    from megazero.checkpoint.sharded import CheckpointError
    from megazero.data import DataError
    from megazero.parallel.grid import ProcessGrid
    from megazero.train.trainer import Trainer, TrainingError

    grid = ProcessGrid.create(cfg.parallel.tp, cfg.parallel.pp, timeout_s=round(cfg.train.timeout_minutes * 60))
    try:
        Trainer(cfg, grid).run()
    except (CheckpointError, DataError, TrainingError) as e:  # the same message on every rank: print it once
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    dist.barrier()  # no rank tears its communicators down while a peer still uses them
    if grid.backend == "nccl":
        dist.destroy_process_group()
        return
    # Gloo: every output is written and closed (metrics, checkpoints), so leave without
    # tearing gloo's C++ state down; that teardown occasionally aborted a finished run with
    # "terminate called without an active exception" (SIGABRT after the last iteration).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
