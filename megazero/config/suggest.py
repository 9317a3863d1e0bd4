"""Did-you-mean for flags and keys: the nearest spelling by edit distance.

Every unknown name gets the closest candidate, whatever the distance: megazero's keys
(`--section.key`, and the bare key name `--num_heads` for `--model.num_heads`), the short
aliases other megazero tools take (`--tp`, `--zero-stage`, ... of the planner) and
Megatron-LM's flags. Underscores and hyphens count alike (`--micro_batch_size` is Megatron's
`--micro-batch-size`).
"""

from __future__ import annotations

from typing import Iterable

# The planner's (python -m megazero.plan) and common short spellings -> the training config key.
ALIASES = {
    "--tp": "parallel.tp",
    "--pp": "parallel.pp",
    "--cp": "parallel.cp",
    "--vpp": "parallel.vpp",
    "--cp-impl": "parallel.cp_impl",
    "--sequence-parallel": "parallel.sequence_parallel",
    "--zero-stage": "zero.stage",
    "--micro-batch": "train.micro_batch_size",
    "--recompute": "train.recompute",
    "--offload-optimizer": "zero.offload_optimizer",
}


def edit_distance(a: str, b: str) -> int:
    """Letters inserted, deleted, changed or swapped with a neighbour to turn `a` into `b`."""
    prev2: list[int] = []
    prev = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        row = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                row[j] = min(row[j], prev2[j - 2] + 1)
        prev2, prev = prev, row
    return prev[-1]


def _plain(name: str) -> str:
    return name.lower().replace("_", "-")


def closest(name: str, candidates: Iterable[tuple[str, str]]) -> str:
    """The suggestion of the (spelling, suggestion) pair whose spelling is nearest to `name`;
    on a tie the earlier pair (list the preferred kind first)."""
    return min(candidates, key=lambda pair: edit_distance(_plain(name), _plain(pair[0])), default=("", ""))[1]


def key_candidates(keys: Iterable[str], dashes: bool = True) -> list[tuple[str, str]]:
    """(spelling, suggestion) for config keys `section.key`: the full name, then the short
    aliases and the bare key names (`num_heads`), each suggesting the full name
    (`--model.num_heads`, or without the dashes for a config file's keys)."""
    keys = list(keys)
    prefix = "--" if dashes else ""
    full = [(f"{prefix}{key}", f"{prefix}{key}") for key in keys]
    aliases = [(alias if dashes else alias[2:], f"{prefix}{key}") for alias, key in ALIASES.items() if key in keys]
    bare = [(f"{prefix}{key.split('.', 1)[1]}", f"{prefix}{key}") for key in keys]
    return full + aliases + bare
