"""Read a safetensors file one tensor at a time without its pages piling up in the RSS.

safetensors memory-maps the whole file for as long as it is open, and every page a tensor
read touches stays mapped (and counted in the process's resident set) until the file is
closed: streaming a 3 GB model through one open file ends with 3 GB resident. Opening the
file anew for each tensor lets each tensor's pages go as soon as its consumer drops it.
"""

from __future__ import annotations

from typing import Iterator

import torch


def stream_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, tensor) for every tensor of the file, in its key order."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        keys = list(f.keys())
    for key in keys:
        with safe_open(path, framework="pt") as f:
            t = f.get_tensor(key)
        yield key, t
