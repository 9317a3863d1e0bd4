"""optim.name muon's (and sgd's) optimizer state: Muon's ranges keep one buffer (exp_avg, the momentum)
and no second moment, in device, host and NVMe stores alike; whole-kind reads and writes keep
the shard's coordinates (the holes read as zeros), so checkpoints keep their format."""

from __future__ import annotations

import torch

from megazero.zero.partition import Range
from megazero.zero.state import Holes, MemoryOptimizerStore, NvmeOptimizerStore

# Shard of 1607 elements; Muon's ranges are [300, 400), [512, 1012) and [1012, 1512) (one
# matrix cut in two by sub_group_size); [1512, 1600) is padding no range covers.
GROUPS = [[Range(0, 0, 300, 0, True, True), Range(0, 300, 100, 300, True, True, muon=True)],
          [Range(1, 0, 500, 512, True, True, muon=True)],
          [Range(1, 500, 500, 1012, True, True, muon=True), Range(2, 0, 7, 1600, False, True)]]
NUMEL = 1607
MUON = [(r.shard_offset, r.length) for g in GROUPS for r in g if r.muon]


def test_holes_map_shard_offsets_to_stored_ones():
    holes = Holes(MUON)
    assert holes.stored(NUMEL) == NUMEL - 1100
    assert [holes.at(o) for o in (0, 300, 400, 512, 1512, 1600)] == [0, 300, 300, 412, 412, 500]
    assert holes.kept(250, 300) == [(250, 50), (400, 112)]
    pieces = holes.in_shard(torch.arange(1.0, NUMEL - 1100 + 1), NUMEL)
    full = torch.cat([p.reshape(-1) for p in pieces])
    assert full.numel() == NUMEL and full[300:400].eq(0).all() and full[512:1512].eq(0).all()
    assert full[400] == 301 and full[1606] == NUMEL - 1100
    assert Holes().in_shard(full, NUMEL)[0] is full  # without Muon, the state itself


def _step_and_read(store, holes: bool = True) -> dict[str, torch.Tensor]:
    """Write every kind whole, step twice through iterate, read every kind back in shard coordinates."""
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        store.write(kind, 0, torch.arange(NUMEL, dtype=torch.float32))
    store.flush()
    for _ in range(2):
        for group, st in store.iterate(GROUPS):
            for r, m, a, s in zip(group, st.master, st.exp_avg, st.exp_avg_sq, strict=True):
                assert s.numel() == (0 if r.muon and holes else r.length) and a.numel() == r.length
                m.add_(1.0)
                a.add_(2.0)
                s.add_(3.0)
    return {k: torch.cat([p.reshape(-1) for p in store.read_pieces(k)]) for k in ("master", "exp_avg", "exp_avg_sq")}


def test_stores_keep_no_second_moment_for_muon(tmp_path):
    covered = torch.zeros(NUMEL, dtype=torch.bool)
    muon = torch.zeros(NUMEL, dtype=torch.bool)
    for g in GROUPS:
        for r in g:
            covered[r.shard_offset: r.shard_offset + r.length] = True
            muon[r.shard_offset: r.shard_offset + r.length] = r.muon
    values = torch.arange(NUMEL, dtype=torch.float32)
    memory = MemoryOptimizerStore(NUMEL, torch.device("cpu"), separate_master=True, holes=Holes(MUON))
    nvme = NvmeOptimizerStore(NUMEL, GROUPS, str(tmp_path), buffer_count=2, pin=False, holes=Holes(MUON))
    plain = MemoryOptimizerStore(NUMEL, torch.device("cpu"), separate_master=True)
    assert memory.nbytes()["cpu"] == plain.nbytes()["cpu"] - 4 * 1100
    assert nvme.file_bytes["exp_avg_sq"] < nvme.file_bytes["exp_avg"]
    for store in (memory, nvme):
        got = _step_and_read(store)
        assert torch.equal(got["exp_avg"][covered], values[covered] + 4)
        adam = covered & ~muon
        assert torch.equal(got["exp_avg_sq"][adam], values[adam] + 6)
        assert got["exp_avg_sq"][muon].eq(0).all() and got["exp_avg_sq"].numel() == NUMEL
    assert torch.equal(_step_and_read(plain, holes=False)["exp_avg_sq"][covered], values[covered] + 6)


def test_sgd_stores_no_second_moment_at_all(tmp_path):
    """optim.name sgd: one hole over the whole shard; every range's exp_avg_sq is empty, nothing
    of it is allocated or written to disk, and it reads back as zeros in shard coordinates."""
    whole = Holes([(0, NUMEL)])
    memory = MemoryOptimizerStore(NUMEL, torch.device("cpu"), separate_master=True, holes=whole)
    nvme = NvmeOptimizerStore(NUMEL, GROUPS, str(tmp_path), buffer_count=2, pin=False, holes=whole)
    assert memory.flat["exp_avg_sq"].numel() == 0 and nvme.file_bytes["exp_avg_sq"] == 0
    for store in (memory, nvme):
        for kind in ("master", "exp_avg", "exp_avg_sq"):
            store.write(kind, 0, torch.arange(NUMEL, dtype=torch.float32))
        store.flush()
        for group, st in store.iterate(GROUPS):
            assert [s.numel() for s in st.exp_avg_sq] == [0] * len(group)
            assert [a.numel() for a in st.exp_avg] == [r.length for r in group]
        second = torch.cat([p.reshape(-1) for p in store.read_pieces("exp_avg_sq")])
        assert second.numel() == NUMEL and second.eq(0).all()
        first = torch.cat([p.reshape(-1) for p in store.read_pieces("exp_avg")])
        covered = torch.cat([torch.arange(r.shard_offset, r.shard_offset + r.length) for g in GROUPS for r in g])
        assert torch.equal(first[covered], covered.float())  # the NVMe store keeps the ranges only
