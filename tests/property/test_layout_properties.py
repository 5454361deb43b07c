"""Hypothesis: the bucket/shard layout covers every element once and balances shards."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero.runtime.buffers.flat_buffer import FlatBuffer
from zero.runtime.buffers.layout import plan_buckets

sizes = st.lists(st.integers(1, 300), min_size=1, max_size=25)


@settings(max_examples=200, deadline=None)
@given(numels=sizes, num_shards=st.integers(1, 9), cap=st.integers(1, 600), align=st.integers(1, 4))
def test_partition_covers_every_element_exactly_once(numels, num_shards, cap, align):
    buckets = plan_buckets(numels, ["fp32"] * len(numels), cap, num_shards, align)
    seen = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for bucket in buckets:
        assert bucket.padded_numel % (num_shards * align) == 0
        assert 0 <= bucket.padding < num_shards * align  # at most one padding block
        assert bucket.numel <= cap or len(bucket.spans) == 1  # over the cap only when one param is
        per_shard_real = []
        for shard in range(num_shards):
            lo, hi = bucket.chunk_range(shard)
            assert hi - lo == bucket.chunk_numel  # every shard is the same size
            real = 0
            for piece in bucket.pieces(shard):
                seen[piece.param_index][piece.param_start : piece.param_start + piece.numel] += 1
                assert 0 <= piece.chunk_start and piece.chunk_start + piece.numel <= bucket.chunk_numel
                real += piece.numel
            per_shard_real.append(real)
        assert max(per_shard_real) - min(per_shard_real) <= bucket.padding
        assert sum(per_shard_real) == bucket.numel
    for counts in seen:
        assert torch.all(counts == 1)
    # parameters keep their order and are packed back to back
    order = [span.param_index for bucket in buckets for span in bucket.spans]
    assert order == list(range(len(numels)))


@settings(max_examples=100, deadline=None)
@given(numels=sizes, keys=st.lists(st.sampled_from(["a", "b"]), min_size=25, max_size=25))
def test_buckets_never_mix_keys(numels, keys):
    keys = keys[: len(numels)]
    for bucket in plan_buckets(numels, keys, 10_000, 2):
        assert {keys[s.param_index] for s in bucket.spans} == {bucket.key}


@settings(max_examples=100, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=8))
def test_flat_buffer_views_round_trip(shapes):
    tensors = [torch.randn(*shape) for shape in shapes]
    total = sum(t.numel() for t in tensors)
    buf = FlatBuffer(total + 3, torch.float32, torch.device("cpu"))
    views, offset = [], 0
    for t in tensors:
        view = buf.view(offset, t.numel(), t.shape)
        view.copy_(t)
        views.append(view)
        offset += t.numel()
    assert torch.equal(buf.data[:total], torch.cat([t.flatten() for t in tensors]))
    buf.free()
    assert not buf.is_allocated and all(v.untyped_storage().size() == 0 for v in views)
    buf.allocate(zero=True)  # the same view objects see the restored storage
    for view, t in zip(views, tensors):
        assert torch.equal(view, torch.zeros_like(t))
        view.copy_(t)
        assert torch.equal(view, t)
