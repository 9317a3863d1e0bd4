"""Host memory at start-up: what offloading will allocate there, against what the machine has.

An offloaded run allocates its host buffers as it builds (NVMe step buffers of
buffer_count x sub_group_size x 12 B, the fp32 gradient shard copied out of a GPU, the
parameter shard or its fetch window, the checkpoint staging buffer; on a CPU-only machine the
whole training footprint too, since the device is the host). When they exceed the memory
available the kernel kills the process with no message. So before building anything every
rank weighs the planner's host figure (plan/formulas.py's host_items, times the ranks on this
node) against MemAvailable, or the cgroup's limit when lower:

    fits                                     nothing changes
    too big, zero.sub_group_size not set     the config the run gets has the largest size that
                                             fits, with one line saying so (cfg.set_keys tells)
    too big, zero.sub_group_size set         refused, naming the largest sub_group_size that fits
    too big with any sub_group_size          refused, naming what needs the memory
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from megazero.config.schema import Config
from megazero.config.sharding import sharding
from megazero.errors import UserError
from megazero.parallel import comm
from megazero.parallel.grid import ProcessGrid
from megazero.plan import formulas as F
from megazero.plan.planner import Cluster, distinct_ranks, predict, run_layout
from megazero.train.summary import size
from megazero.zero import ALIGN

USABLE = 0.9
"""Fraction of the available memory a run may plan to fill: the rest absorbs the prediction's
error (within 15% of the measured peak: scripts/bench_memory.py) and the page cache's needs."""


class HostMemoryError(UserError):
    """Offloading would need more host memory than this machine has (one line, with the fix)."""


# ---------------------------------------------------------------------------- what the machine has


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def available_host_bytes(proc: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """MemAvailable, or what this cgroup may still take (limit minus usage) when that is less."""
    with open(proc) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) * 1024
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2, then v1
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        limit, usage = _read_int(os.path.join(cgroup, limit_file)), _read_int(os.path.join(cgroup, usage_file))
        if limit is not None and usage is not None and limit < 1 << 60:  # v1's "unlimited" is a huge number
            available = min(available, max(0, limit - usage))
    return available


# ---------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class HostNeed:
    """One rank's host bytes: `fixed` whatever the sub-groups, plus `per_element` for each
    element of one sub-group up to `cap` (a sub-group never holds more than the shard)."""

    fixed: int
    per_element: int
    cap: int
    items: dict[str, int]
    """What `fixed` and the sub-group buffers are made of, for the message."""


def fit_sub_group_size(need: HostNeed, ranks: int, available: int, requested: int, explicit: bool) -> \
        tuple[int, Optional[str]]:
    """The sub-group size to run with and the line to print (None when `requested` fits in
    USABLE x `available`); raises HostMemoryError when nothing fits or an explicit size does not."""
    total = ranks * (need.fixed + need.per_element * min(requested, need.cap))
    usable = int(USABLE * available)
    if total <= usable:
        return requested, None
    spare = usable // ranks - need.fixed
    largest = spare // need.per_element // ALIGN * ALIGN if need.per_element and spare > 0 else 0
    gib = f"{size(available)} available (MemAvailable or the cgroup limit; {USABLE:.0%} of it usable)"
    per_rank = f" x {ranks} ranks on this node" if ranks > 1 else ""
    if largest < ALIGN:
        held = ", ".join(f"{k.replace('_', ' ')} {size(v)}" for k, v in need.items.items()
                         if v and k != "nvme_step_buffers")
        raise HostMemoryError(f"host memory: this run needs {size(ranks * need.fixed)} before any NVMe step buffer "
                              f"({held} per rank{per_rank}) but {gib}; use more ranks or nodes (each holds less), "
                              f"a smaller train.micro_batch_size, offloading to nvme, or free memory")
    if explicit:
        raise HostMemoryError(f"zero.sub_group_size {requested} needs {size(total)} of host memory "
                              f"(NVMe step buffers {need.per_element} B per element{per_rank}) but {gib}; the "
                              f"largest that fits is --zero.sub_group_size {largest}")
    return largest, (f"zero.sub_group_size: the default {requested} would need {size(total)} of host memory "
                     f"but {gib}; using {largest} (set it to choose)")


# ---------------------------------------------------------------------------- this run


def offloads(cfg: Config) -> bool:
    z = cfg.zero
    return z.offload_optimizer != "none" or (sharding(z.stage).parameters and z.offload_param != "none")


def host_need(cfg: Config, grid: ProcessGrid) -> HostNeed:
    """The worst pipeline rank's host bytes per the planner (on a CPU-only machine the whole
    predicted peak too: the device is the host), split into what the sub-group size changes
    and what it does not."""
    p, device_is_host = cfg.parallel, grid.device.type == "cpu"
    layout = run_layout(cfg, grid.dp, grid.cp)
    cluster = Cluster(grid.world_size, grid.world_size, 1.0, None)  # memory only: no device size, no times
    ranks = predict(cfg, layout, cluster, pp_layers=p.pp_layers, ranks=distinct_ranks(p.pp),
                    device=grid.device.type).ranks
    worst = max(ranks, key=lambda r: r.host + (r.peak if device_is_host else 0))
    items = dict(worst.host_items)
    step_buffers = items.pop("nvme_step_buffers")
    if device_is_host:
        items["training"] = worst.peak
    per_element = cfg.zero.buffer_count * F.NVME_STEP_BYTES if step_buffers else 0
    # The buffers' elements: min(sub_group_size, shard). Capping a smaller size there is exact
    # too, since only smaller sizes are ever tried.
    cap = step_buffers // per_element if per_element else 0
    return HostNeed(sum(items.values()), per_element, cap, {**items, "nvme_step_buffers": step_buffers})


def fit_host_memory(cfg: Config, grid: ProcessGrid, available: Optional[int] = None) -> Config:
    """Collective, the last step of resolution (it needs the grid): weigh this run's host
    allocations against the memory available (see the module docstring) and return the config
    to run: `cfg` itself, or a copy with the largest zero.sub_group_size that fits, which rank 0
    reports in one line. `cfg` is never changed. Every rank stops when one refuses.
    `available`: the memory to assume (tests), else the machine's."""
    if not offloads(cfg):
        return cfg
    z = cfg.zero
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def decide() -> tuple[int, Optional[str]]:
        free = available if available is not None else available_host_bytes()
        return fit_sub_group_size(host_need(cfg, grid), ranks_here, free, z.sub_group_size,
                                  explicit="zero.sub_group_size" in cfg.set_keys)
    size, line = comm.agreed(decide, grid["world"])
    if line and grid.rank == 0:
        print(line, flush=True)
    return cfg if size == z.sub_group_size else dataclasses.replace(cfg, zero=dataclasses.replace(z, sub_group_size=size))
