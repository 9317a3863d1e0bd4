"""Optimizer and parameter offload (zero.offload_optimizer cpu | nvme, and at stage 3
zero.offload_param cpu | nvme): the same losses and parameters as in-memory at stages 1-3, state that checkpoints like any other, the NVMe store's streaming,
and clear errors for bad settings."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import make_config, make_trainer, run_distributed
from megazero.config import ConfigError
from megazero.errors import UserError
from megazero.zero.partition import Range
from megazero.zero.state import NvmeOptimizerStore

TINY = ["--model.seq_length", "32", "--train.global_batch_size", "8", "--train.micro_batch_size", "2",
        "--zero.sub_group_size", "5000", "--zero.bucket_size", "20000", "--optim.clip_grad", "0.5"]


def _run(args: list[str], iters: int) -> dict:
    """`iters` steps on this world; losses, full parameters, and the optimizer's state_dict."""
    tr = make_trainer(TINY + args)
    losses = [tr.train_step()["loss"] for _ in range(iters)]
    return {"losses": losses, "params": tr.optimizer.sharded.full_state_dict(), "state": tr.optimizer.state_dict(),
            "bytes": tr.optimizer.model_state_bytes(), "optimizer": tr.optimizer, "trainer": tr}


OPTIMIZER = {"cpu": ["--zero.offload_optimizer", "cpu"], "nvme": ["--zero.offload_optimizer", "nvme"]}
PARAMS = {"param cpu": ["--zero.offload_param", "cpu"],  # stage 3: parameters offloaded too
          "param nvme + nvme": ["--zero.offload_param", "nvme", "--zero.offload_optimizer", "nvme"],
          "param nvme + cpu": ["--zero.offload_param", "nvme", "--zero.offload_optimizer", "cpu"]}


def _offload_world(nvme: str) -> list:
    """Every stage x offload mode (and bf16 through NVMe) against its in-memory run, in one
    spawned world. NVMe runs stream 2-3 sub-groups through 2 buffers (the smallest ring)."""
    out = []
    cases = [(1, "fp32", OPTIMIZER), (2, "fp32", OPTIMIZER), (3, "fp32", {**OPTIMIZER, **PARAMS}),
             (2, "bf16", OPTIMIZER), (3, "bf16", {k: PARAMS[k] for k in ("param cpu", "param nvme + cpu")})]
    for stage, precision, modes in cases:
        base = ["--zero.stage", str(stage), "--train.precision", precision]
        ref = _run(base, 3)
        for mode, args in modes.items():
            extra = args + ["--zero.nvme_path", nvme, "--zero.buffer_count", "2"]
            got = _run(base + extra, 3)
            equal_state = all(torch.equal(got["state"][k], ref["state"][k]) for k in ("master", "exp_avg", "exp_avg_sq"))
            # Resume: a fresh offloaded optimizer loads the state (and the model's shards) and
            # hands back the same.
            again = _run(base + extra, 0)["optimizer"]
            again.load_model_state_dict(got["optimizer"].sharded.model_state_dict())
            again.load_state_dict(got["state"])
            reloaded = again.state_dict()
            bytes_ = got["bytes"]
            out.append({"case": (stage, precision, mode),
                        "dloss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
                        "params_equal": all(torch.equal(got["params"][n], p) for n, p in ref["params"].items()),
                        "state_equal": equal_state,
                        "reload_equal": all(torch.equal(reloaded[k], got["state"][k])
                                            for k in ("master", "exp_avg", "exp_avg_sq")),
                        "model_reload_equal": all(torch.equal(again.sharded.full_state_dict()[n], p)
                                                  for n, p in got["params"].items()),
                        "on_device": {k: bytes_[k] for k in ("optimizer", "params")},
                        "offloaded": bytes_["offloaded_host"] + bytes_["offloaded_nvme"],
                        "files_left": [f for f in os.listdir(nvme) if f.startswith(".megazero-swap")]})
    return out


def _gradients_leave_during_backward() -> list:
    """ZeRO-Offload's device-to-host gradient path, forced on (this host has no device to
    copy from): each bucket's slice is copied once final, before the backward ends."""
    from megazero.zero.shard import ShardedParameters
    out = []
    ShardedParameters._offloads_gradients = lambda self: True
    for stage in (1, 2, 3):
        base = ["--zero.stage", str(stage)]
        ref = _run(base, 2)
        trainer = _run(base + OPTIMIZER["cpu"], 0)["trainer"]
        opt = trainer.optimizer
        before_finish, finish = [], opt.grads.finish
        opt.grads.finish = lambda seen=before_finish, o=opt, f=finish: seen.append(o.host_grads.copied_numel) or f()
        losses = [trainer.train_step()["loss"] for _ in range(2)]
        out.append({"stage": stage, "dloss": max(abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)),
                    "before_finish": before_finish, "copied": opt.host_grads.copied_numel,
                    "numel": opt.layout.trainable_numel})
    return out


def _checkpoint_through_files(root: str, nvme: str) -> dict:
    """Stage 3 with parameters and optimizer on NVMe, through real checkpoint files: a save
    that cannot get scratch space on rank 1 fails on every rank and keeps the last
    checkpoint; a resume from that checkpoint continues bitwise."""
    import errno

    import torch.distributed as dist

    from megazero.checkpoint.base import CheckpointSaveError

    def trainer(extra: list[str]):
        return make_trainer(TINY + ["--zero.stage", "3", "--zero.nvme_path", nvme, "--zero.buffer_count", "2",
                                    "--checkpoint.save", root, "--train.iters", "1", *PARAMS["param nvme + nvme"],
                                    *extra])

    first = trainer([])
    first.run()  # iteration 1 saved
    reference = [first.train_step()["loss"] for _ in range(2)]
    fallocate = os.posix_fallocate
    if dist.get_rank() == 1:
        def no_room(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")
        os.posix_fallocate = no_room
    try:
        first.checkpoints.save(first.iteration)
        failure = None
    except CheckpointSaveError as e:
        failure = str(e)
    finally:
        os.posix_fallocate = fallocate
    resumed = trainer(["--checkpoint.load", root])
    return {"failure": failure, "latest": open(os.path.join(root, "latest")).read(),
            "reference": reference, "resumed": [resumed.train_step()["loss"] for _ in range(2)]}


def test_gradients_are_copied_to_the_host_as_their_buckets_finish():
    for rank_out in run_distributed(_gradients_leave_during_backward, 2):
        for r in rank_out:
            assert r["dloss"] <= 1e-6, r
            assert r["copied"] == r["numel"], r  # every gradient element once per iteration
            assert all(0 < n < r["numel"] for n in r["before_finish"]), r  # most during backward


def test_offloaded_checkpoints_save_resume_and_fail_cleanly(tmp_path):
    root, nvme = tmp_path / "ckpt", tmp_path / "nvme"
    nvme.mkdir()
    for out in run_distributed(_checkpoint_through_files, 2, str(root), str(nvme)):
        assert out["failure"].startswith(f"saving iteration 3 to {root} failed on rank 1: "), out
        assert f"zero.nvme_path {nvme}: cannot reserve" in out["failure"], out
        assert out["latest"] == "iter_0000001", out
        assert out["resumed"] == out["reference"], out  # bitwise


def test_offload_equals_in_memory_at_every_stage(tmp_path):
    for rank_out in run_distributed(_offload_world, 2, str(tmp_path)):
        for r in rank_out:
            assert r["dloss"] <= 1e-6 and r["params_equal"] and r["state_equal"] and r["reload_equal"], r
            assert r["model_reload_equal"], r
            mode = r["case"][2]
            assert r["offloaded"] > 0, r
            assert (r["on_device"]["optimizer"] == 0) == (mode != "param cpu"), r
            assert (r["on_device"]["params"] == 0) == mode.startswith("param"), r
            assert r["files_left"] == [], r  # swap files are unlinked as soon as they are open


def test_nvme_store_streams_sub_groups_and_keeps_what_the_step_wrote(tmp_path):
    groups = [[Range(0, 0, 300, 0, True, True), Range(0, 300, 100, 300, False, True)],
              [Range(1, 0, 1000, 512, True, True)], [Range(2, 0, 7, 1600, True, True)]]
    store = NvmeOptimizerStore(1607, groups, str(tmp_path), buffer_count=2, pin=False)
    values = torch.arange(1607, dtype=torch.float32)
    store.write("master", 0, values)
    store.flush()
    for _ in range(2):  # two passes: what one pass writes back, the next reads
        for group, st in store.iterate(groups):
            for m, a, r in zip(st.master, st.exp_avg, group, strict=True):
                m.add_(1.0)
                a.fill_(r.bucket + 1)
    master, exp_avg = store.read("master"), store.read("exp_avg")
    covered = torch.zeros(1607, dtype=torch.bool)
    for g in groups:
        for r in g:
            covered[r.shard_offset: r.shard_offset + r.length] = True
    assert torch.equal(master[covered], values[covered] + 2)
    assert torch.equal(master[~covered], torch.zeros(int((~covered).sum())))  # padding is not stored
    assert exp_avg[1600:1607].eq(3).all() and exp_avg[512:1512].eq(2).all()
    assert store.bytes_read > 0 and store.bytes_written > 0
    # A checkpoint's copy of swapped state is file-backed under nvme_path (never wholly in
    # memory) and the scratch file is gone from the directory already.
    assert master.untyped_storage().filename.startswith(str(tmp_path))
    assert not [n for n in os.listdir(tmp_path) if "scratch" in n]


def test_nvme_shard_writes_back_behind_and_reads_ahead(tmp_path):
    """Stage-3 parameters on NVMe: a bucket's write-back runs on the writer thread while the
    next bucket (read ahead) is updated; a load or read after it sees the written values."""
    from megazero.config.sharding import DENSE
    from megazero.zero.partition import build_layout
    from megazero.zero.shard_home import NvmeShard
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (700, 300, 1000)]
    layout = build_layout([(0, [(f"p{i}", p)]) for i, p in enumerate(params)], {DENSE.zero: (2, 1)})
    home = NvmeShard(layout, torch.float32, str(tmp_path), pin=False)
    for step in range(3):
        for b in sorted(layout.buckets, key=lambda b: b.shard_offset):
            home.write(b.shard_offset, torch.full((b.shard_numel,), float(10 * step + b.index)))
            assert home.ahead is None or home.ahead[0] != b.index
        home.flush()
        assert home.writing  # the last bucket's write-back is still behind us
        for b in layout.buckets:
            assert home.load(b).result().eq(10 * step + b.index).all()
    assert home.read(0, layout.shard_numel).numel() == layout.shard_numel
    assert home.file.bytes_written >= 3 * home.file_bytes  # every region written back each step


def test_large_rank_files_load_memory_mapped_after_their_digest_checks_out(tmp_path, monkeypatch):
    from megazero.checkpoint import digest
    path = str(tmp_path / "rank.pt")
    state = {"exp_avg": torch.arange(1000, dtype=torch.float32)}
    with open(path, "wb") as f:
        writer = digest.HashingWriter(f)
        torch.save(state, writer)
    entry = writer.entry()
    monkeypatch.setattr(digest, "IN_MEMORY_BYTES", 0)
    calls, load = [], torch.load
    monkeypatch.setattr(torch, "load", lambda f, **kw: calls.append((f, kw)) or load(f, **kw))
    loaded = digest.load_torch(path, entry)
    assert torch.equal(loaded["exp_avg"], state["exp_avg"])
    assert calls == [(path, {"map_location": "cpu", "weights_only": True, "mmap": True})]
    with open(path, "r+b") as f:  # a flipped byte is caught before anything is mapped
        f.seek(-200, os.SEEK_END)
        byte = f.read(1)
        f.seek(-200, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(digest.DigestError, match="sha256"):
        digest.load_torch(path, entry)


def test_nvme_store_refuses_a_disk_without_room(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 4096, 4096))
    with pytest.raises(UserError, match=r"has 0\.0 GiB free but the optimizer swap files need"):
        NvmeOptimizerStore(10**6, [[Range(0, 0, 10**6, 0, True, True)]], str(tmp_path), buffer_count=2, pin=False)


@pytest.mark.parametrize("args, message", [
    (["--zero.offload_optimizer", "cpu"], r"needs zero.stage 1, 2 or 3 \(got 0\)"),
    (["--zero.stage", "2", "--zero.offload_param", "cpu"], r"offload_param cpu .* needs zero.stage 3 \(got 2\)"),
    (["--zero.stage", "3", "--zero.offload_param", "nvme"], r"zero.offload_param nvme needs zero.nvme_path"),
    (["--zero.stage", "1", "--zero.offload_optimizer", "nvme"], r"needs zero.nvme_path"),
    (["--zero.stage", "1", "--zero.offload_optimizer", "nvme", "--zero.nvme_path", "setup.cfg/swap"],
     r"zero.nvme_path setup.cfg/swap cannot be created: .*setup.cfg is a file"),
    (["--zero.stage", "1", "--zero.offload_optimizer", "nvme", "--zero.nvme_path", "/tmp", "--zero.buffer_count",
      "1"], r"zero.buffer_count \(1\) must be at least 2"),
])
def test_bad_offload_settings_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        make_config(TINY + args, world=1)


def _offload_3d_world(nvme: str) -> dict:
    base = ["--zero.stage", "3", "--parallel.tp", "2", "--parallel.pp", "2"]
    ref = _run(base, 3)
    got = _run(base + ["--zero.offload_optimizer", "nvme", "--zero.offload_param", "nvme", "--zero.nvme_path", nvme,
                       "--zero.buffer_count", "2"], 3)
    # Only the last pipeline stage has the loss.
    return {"dloss": max((abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True) if a is not None),
                         default=0.0),
            "params_equal": all(torch.equal(got["params"][n], p) for n, p in ref["params"].items())}


@pytest.mark.slow
def test_parameter_and_optimizer_nvme_offload_equal_in_memory_at_tp2_pp2_dp2(tmp_path):
    for out in run_distributed(_offload_3d_world, 8, str(tmp_path)):
        assert out["dloss"] <= 1e-6 and out["params_equal"], out


def _nvme_folder_made(nvme: str) -> bool:
    make_trainer(TINY + ["--zero.stage", "1", "--zero.offload_optimizer", "nvme", "--zero.nvme_path", nvme,
                         "--zero.buffer_count", "2"])
    return os.path.isdir(nvme)


def test_missing_nvme_path_is_created(tmp_path):
    """As DeepSpeed makes its swap folders: a missing zero.nvme_path (and its parents) is created."""
    nvme = str(tmp_path / "not" / "yet")
    assert make_config(TINY + ["--zero.stage", "1", "--zero.offload_optimizer", "nvme", "--zero.nvme_path", nvme],
                       world=1).zero.nvme_path == nvme  # valid before it exists
    assert run_distributed(_nvme_folder_made, 1, nvme) == [True]
