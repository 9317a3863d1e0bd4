"""Host memory at start-up (megazero/train/host_memory.py): offloading's host buffers weighed
against small synthetic amounts of available memory, never by exhausting the machine; and the
planner's host figure against the buffers a run really allocates."""

from __future__ import annotations

import pytest

from helpers import make_config, make_trainer, run_distributed
from megazero.config.schema import ZeroConfig
from megazero.errors import UserError
from megazero.train.host_memory import (
    USABLE,
    HostMemoryError,
    HostNeed,
    available_host_bytes,
    fit_sub_group_size,
)
from megazero.zero import ALIGN

MiB = 2 ** 20
DEFAULT_SUB_GROUP_SIZE = ZeroConfig().sub_group_size
# 100 MiB fixed, NVMe step buffers of 4 x 12 B per element, a shard of 50M elements.
NEED = HostNeed(fixed=100 * MiB, per_element=48, cap=50_000_000,
                items={"training": 100 * MiB, "nvme_step_buffers": 48 * 50_000_000})


def test_a_run_that_fits_is_left_alone():
    assert fit_sub_group_size(NEED, 1, 10_000 * MiB, DEFAULT_SUB_GROUP_SIZE, explicit=False) == \
        (DEFAULT_SUB_GROUP_SIZE, None)


def test_the_default_sub_group_size_shrinks_to_the_largest_that_fits():
    available = 1000 * MiB
    size, line = fit_sub_group_size(NEED, 1, available, DEFAULT_SUB_GROUP_SIZE, explicit=False)
    assert size % ALIGN == 0
    assert NEED.fixed + 48 * size <= USABLE * available < NEED.fixed + 48 * (size + ALIGN)
    assert line is not None and "\n" not in line and f"using {size}" in line and "zero.sub_group_size" in line


def test_ranks_on_one_node_share_the_memory():
    one, _ = fit_sub_group_size(NEED, 1, 1000 * MiB, DEFAULT_SUB_GROUP_SIZE, explicit=False)
    four, _ = fit_sub_group_size(NEED, 4, 1000 * MiB, DEFAULT_SUB_GROUP_SIZE, explicit=False)
    assert 4 * (NEED.fixed + 48 * four) <= USABLE * 1000 * MiB and four < one


def test_an_explicit_size_that_cannot_fit_is_refused_naming_the_largest_that_does():
    largest, _ = fit_sub_group_size(NEED, 1, 1000 * MiB, DEFAULT_SUB_GROUP_SIZE, explicit=False)
    with pytest.raises(HostMemoryError) as e:
        fit_sub_group_size(NEED, 1, 1000 * MiB, 40_000_000, explicit=True)
    message = str(e.value)
    assert "\n" not in message and f"--zero.sub_group_size {largest}" in message and "40000000" in message
    # One that fits is kept as it is.
    assert fit_sub_group_size(NEED, 1, 1000 * MiB, largest, explicit=True) == (largest, None)


def test_when_nothing_fits_the_refusal_names_what_needs_the_memory():
    with pytest.raises(HostMemoryError) as e:
        fit_sub_group_size(NEED, 2, 100 * MiB, DEFAULT_SUB_GROUP_SIZE, explicit=False)
    message = str(e.value)
    assert "\n" not in message and "training 100.00 MiB" in message and "x 2 ranks" in message


def test_available_memory_is_the_lower_of_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("max\n")  # no limit
    (v2 / "memory.current").write_text("123\n")
    assert available_host_bytes(str(meminfo), str(v2)) == 8_000_000 * 1024
    (v2 / "memory.max").write_text(f"{3 * 2 ** 30}\n")
    (v2 / "memory.current").write_text(f"{2 ** 30}\n")
    assert available_host_bytes(str(meminfo), str(v2)) == 2 * 2 ** 30
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 ** 63 - 4096}\n")  # v1's "unlimited"
    (v1 / "memory" / "memory.usage_in_bytes").write_text("5\n")
    assert available_host_bytes(str(meminfo), str(v1)) == 8_000_000 * 1024


NVME = ["--zero.stage", "3", "--zero.offload_optimizer", "nvme", "--zero.offload_param", "nvme",
        "--zero.buffer_count", "2", "--model.seq_length", "32", "--train.global_batch_size", "4",
        "--train.micro_batch_size", "2"]


def _auto_sized_run(nvme: str) -> dict:
    """Start-up with a synthetic amount of memory that leaves the step buffers room for about
    a tenth of the shard: the default sub_group_size shrinks, the run trains, and the buffers
    it allocates are what the planner said."""
    import contextlib
    import io

    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.host_memory import fit_host_memory, host_need
    cfg = make_config(NVME + ["--zero.nvme_path", nvme], world=dist.get_world_size())
    grid = ProcessGrid.create(1, 1)
    need = host_need(cfg, grid)
    available = int((need.fixed + need.per_element * need.cap // 10) / USABLE)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        fitted = fit_host_memory(cfg, grid, available)
    size = fitted.zero.sub_group_size
    assert cfg.zero.sub_group_size != size and "zero.sub_group_size" not in fitted.set_keys  # a copy, resolved
    tr = make_trainer(NVME + ["--zero.nvme_path", nvme, "--zero.sub_group_size", str(size)])
    loss = tr.train_step()["loss"]
    store = tr.optimizer.state
    allocated = sum(t.numel() * t.element_size() for buffers in store.buffers for t in buffers.values())
    return {"line": said.getvalue(), "size": size, "shard": need.cap, "loss": loss, "allocated": allocated,
            "predicted": need.per_element * min(size, need.cap), "fits": need.fixed + need.per_element * size}


def test_the_default_sub_group_size_shrinks_at_start_up_and_the_run_trains(tmp_path):
    out = run_distributed(_auto_sized_run, 1, str(tmp_path))[0]
    assert out["line"].count("\n") == 1 and f"using {out['size']}" in out["line"]
    assert 0 < out["size"] < out["shard"] and out["loss"] == out["loss"]
    # The planner's step-buffer figure is what the NVMe store allocates (up to each buffer's
    # alignment to 4 KiB blocks and the padding between sub-group ranges).
    assert out["predicted"] <= out["allocated"] <= out["predicted"] * 1.05 + 3 * 2 * 8192


def _explicit_refused(nvme: str) -> str:
    """Rank 1 alone is short of memory for an explicit sub_group_size; what each rank raises."""
    import torch.distributed as dist

    from megazero.parallel.grid import ProcessGrid
    from megazero.train.host_memory import fit_host_memory, host_need
    cfg = make_config(NVME + ["--zero.nvme_path", nvme, "--zero.sub_group_size", "4096"], world=dist.get_world_size())
    grid = ProcessGrid.create(1, 1)
    need = host_need(cfg, grid)
    available = 1 << 40 if dist.get_rank() == 0 else int((need.fixed + need.per_element * 1024) / USABLE) + 64
    try:
        fit_host_memory(cfg, grid, available)
    except UserError as e:
        return str(e)
    return "not refused"


@pytest.mark.slow  # suite budget
def test_an_explicit_sub_group_size_that_does_not_fit_on_one_rank_stops_every_rank(tmp_path):
    messages = run_distributed(_explicit_refused, 2, str(tmp_path))
    assert messages[0] == messages[1] and "\n" not in messages[0]
    assert messages[0].startswith("rank 1: zero.sub_group_size 4096 needs") and "--zero.sub_group_size 1024" in messages[0]


def _snapshot_bytes(save: str) -> tuple[int, int]:
    """What checkpoint.async_save's snapshot holds after one save at ZeRO-1 with the optimizer
    on the host, and the planner's host item for it."""
    from megazero.plan.planner import Cluster, predict, run_layout
    tr = make_trainer(["--zero.stage", "1", "--zero.offload_optimizer", "cpu", "--checkpoint.save", save,
                       "--checkpoint.async_save", "true", "--model.seq_length", "32",
                       "--train.global_batch_size", "4", "--train.micro_batch_size", "2"])
    tr.train_step()
    tr.checkpoints.save(tr.iteration)
    layout = run_layout(tr.cfg, tr.grid.dp, tr.grid.cp)
    rank = predict(tr.cfg, layout, Cluster(2, 2, 1.0, None), ranks=[0], device="cpu").rank(0)
    assert tr.checkpoints.snapshot is not None
    return tr.checkpoints.snapshot.nbytes(), rank.host_items["async_snapshot"]


def test_the_async_save_snapshot_is_in_the_host_figure(tmp_path):
    for measured, predicted in run_distributed(_snapshot_bytes, 2, str(tmp_path / "ckpt")):
        assert measured == predicted > 0
