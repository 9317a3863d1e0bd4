"""The one dispatcher: `open_checkpoint(path)` opens every checkpoint kind a tool is given
with its reader, as a `Checkpoint` (base.py).

    save directory        SAVE/ with a `latest` file, or Megatron's                       sharded.py
                          latest_checkpointed_iteration.txt (or `iteration` picks SAVE/iter_N)
    iter_ directory       SAVE/iter_NNNNNNN with metadata.json and the rank files          sharded.py
    universal checkpoint  DIR/universal.json + {master,exp_avg,exp_avg_sq}.safetensors   universal.py
    torch export          FILE (one state_dict) with FILE.config.json beside it; also the  plain.py
                          model_16bit.safetensors written during training
    Hugging Face GPT-2    DIR/config.json + model.safetensors                              hf.py
    DeepSpeed checkpoint  DIR with `latest` naming global_stepN/, a global_stepN/ folder   deepspeed.py
                          or a universal folder (ds_to_universal.py), of an HF GPT-2 (its
                          config.json beside it, or the model section the caller states)
"""

from __future__ import annotations

import os
from typing import Optional

from megazero.checkpoint.base import Checkpoint, CheckpointError, complete_checkpoints, not_a_checkpoint
from megazero.checkpoint.deepspeed import deepspeed_folder, open_deepspeed
from megazero.checkpoint.hf import open_hf
from megazero.checkpoint.meta import LATEST, MEGATRON_LATEST
from megazero.checkpoint.plain import open_model_16bit, open_torch_export
from megazero.checkpoint.sharded import open_sharded, resolve
from megazero.checkpoint.universal import open_universal
from megazero.config import Config


def open_checkpoint(path: str, iteration: int = 0, stated: Optional[Config] = None) -> Checkpoint:
    """Open any accepted kind (see the module docstring); CheckpointError names the fix.
    `stated`: the run's config, whose model section a checkpoint that does not record its model
    (DeepSpeed's without config.json) holds, checked against the shapes it records."""
    if not os.path.exists(path):
        raise not_a_checkpoint(path, "no such file or directory")
    complete = complete_checkpoints(path)
    if iteration:
        if not complete:
            raise CheckpointError(f"--iteration {iteration} picks an iter_ directory inside a save directory, "
                                  f"but '{path}' holds none; pass the checkpoint itself without --iteration")
        ckpt = resolve(path, iteration)
        if not os.path.isdir(ckpt):
            raise CheckpointError(f"save directory '{path}' has no {os.path.basename(ckpt)} "
                                  f"(complete checkpoints: {', '.join(complete)})")
        return open_sharded(ckpt, "save directory")
    if os.path.isfile(path):
        return open_model_16bit(path) if path.endswith(".safetensors") else open_torch_export(path)
    if os.path.isfile(os.path.join(path, "universal.json")):
        return open_universal(path)
    if os.path.isfile(os.path.join(path, "metadata.json")):
        return open_sharded(path, "iter_ directory")
    if deepspeed_folder(path):  # before `latest` and config.json: DeepSpeed's folders have both
        return open_deepspeed(path, stated)
    if any(os.path.isfile(os.path.join(path, name)) for name in (LATEST, MEGATRON_LATEST)):
        return open_sharded(resolve(path), "save directory")
    if os.path.isfile(os.path.join(path, "config.json")):
        return open_hf(path)
    if complete:
        raise CheckpointError(f"save directory '{path}' has no '{LATEST}' file; pass one of its "
                              f"checkpoints, e.g. {os.path.join(path, complete[-1])}")
    raise not_a_checkpoint(path, "a directory without latest, metadata.json, universal.json, config.json or "
                                 "*model_states.pt")
