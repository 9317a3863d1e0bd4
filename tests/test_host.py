"""Host copies through one staging buffer: exact, in bounded pieces, never aliasing the source."""

from __future__ import annotations

import torch

from megazero.parallel.host import HostStaging


def test_pieces_concat_and_copies_are_exact():
    x = torch.randn(1000)
    staging = HostStaging(piece_bytes=1536)
    assert [p.numel() for p in staging.host_bytes(x)] == [1536, 1536, 928]
    y = staging.copy(x)
    assert torch.equal(x, y) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    joined = staging.concat([x[:10], x.to(torch.bfloat16)])
    assert torch.equal(joined[:10], x[:10]) and torch.equal(joined[10:], x.to(torch.bfloat16).float())
