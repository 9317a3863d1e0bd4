"""Host copies through one staging buffer: exact, in bounded pieces, never aliasing the source;
the asynchronous save's snapshot tensors, reused from one save to the next."""

from __future__ import annotations

import torch

from megazero.parallel.host import HostSnapshot, HostStaging


def test_pieces_concat_and_copies_are_exact():
    x = torch.randn(1000)
    staging = HostStaging(piece_bytes=1536)
    assert [p.numel() for p in staging.host_bytes(x)] == [1536, 1536, 928]
    y = staging.copy(x)
    assert torch.equal(x, y) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    joined = staging.concat([x[:10], x.to(torch.bfloat16)])
    assert torch.equal(joined[:10], x[:10]) and torch.equal(joined[10:], x.to(torch.bfloat16).float())


def test_snapshot_reuses_its_tensors_and_never_aliases_the_source():
    x = torch.randn(1000)
    snapshot = HostSnapshot()
    first = snapshot.concat("master", [x[:10], x[10:].to(torch.bfloat16)])
    assert torch.equal(first[:10], x[:10]) and torch.equal(first[10:], x[10:].to(torch.bfloat16).float())
    assert first.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    x.add_(1.0)  # training goes on: the snapshot keeps the values it copied
    assert not torch.equal(first[:10], x[:10])
    again = snapshot.concat("master", [x])  # the next save refills the same memory
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, x)
    assert snapshot.concat("master", [x[:5]]).numel() == 5 and snapshot.nbytes() == 5 * 4
