"""Block-wise int8 quantization (``zero.comm.quantization``), the wire format of the quantized codecs: the packet's
size, the stated bound on every element (property-tested over sizes, blocks, magnitudes and dtypes), exactness
where it must be exact, and non-finite values never hidden."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zero.comm import quantization
from zero.comm.policy import Communication


def _encoded(chunks: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    rows, n = chunks.shape
    packets = torch.empty(rows, quantization.packet_bytes(n, block, bits), dtype=torch.uint8)
    quantization.encode(chunks, block, packets, bits)
    return packets


def _decoded(packet: torch.Tensor, n: int, block: int, bits: int = 8) -> torch.Tensor:
    return torch.cat([quantization.decode(packet, n, block, a, b, bits) for a, b in quantization.slices(n, block)])


def _roundtrip(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    return _decoded(_encoded(x.view(1, -1), block, bits)[0], x.numel(), block, bits)


def _whole_packet(x: torch.Tensor, block: int, bits: int = 8) -> torch.Tensor:
    """The packet of ``x`` (1D) computed in one go: the format's definition, without slices."""
    blocks, top = quantization.num_blocks(x.numel(), block), quantization.levels(bits)
    padded = torch.zeros(blocks * block, dtype=torch.float32)
    padded[: x.numel()] = x
    scales = padded.view(blocks, block).abs().amax(dim=1) / top
    q = (padded.view(blocks, block) / torch.where(scales == 0, 1.0, scales).unsqueeze(1)).round().clamp(-top, top)
    if bits == 8:
        values = q.to(torch.int8).view(torch.uint8).reshape(-1)
    else:  # value i in the low nibble of byte i // 2 when i is even, else the high one; each offset by 8
        nibbles = (q.reshape(-1) + 8).to(torch.uint8)
        values = nibbles[0::2] + nibbles[1::2] * 16
    pad = torch.zeros(-len(values) % 4, dtype=torch.uint8)
    return torch.cat([values, pad, scales.view(torch.uint8)])


@pytest.mark.parametrize("n,block,bits,expected", [(256, 256, 8, 256 + 4), (257, 256, 8, 512 + 8), (7, 4, 8, 8 + 8),
                                                   (5, 3, 8, 8 + 8), (1, 16, 8, 16 + 4), (256, 256, 4, 128 + 4),
                                                   (257, 256, 4, 256 + 8), (7, 4, 4, 4 + 8), (1, 16, 4, 8 + 4)])
def test_a_packet_is_the_padded_values_then_one_fp32_scale_per_block(n, block, bits, expected):
    assert quantization.packet_bytes(n, block, bits) == expected


def test_bytes_per_element_approach_one_quarter_of_fp32():
    n = 1 << 20
    assert quantization.packet_bytes(n, 256) / (4 * n) == pytest.approx(0.25 + 1 / 256)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 700), block=st.sampled_from([4, 16, 64, 256]), seed=st.integers(0, 2**16),
       spread=st.integers(0, 6), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       bits=st.sampled_from(quantization.BITS))
def test_every_element_decodes_within_its_blocks_bound(n, block, seed, spread, dtype, bits):
    gen = torch.Generator().manual_seed(seed)
    spread = min(spread, 3) if dtype == torch.float16 else spread  # (float16 tops out at 65504)
    x = (torch.randn(n, generator=gen) * 10.0 ** torch.randint(-spread, spread + 1, (n,), generator=gen)).to(dtype)
    decoded = _roundtrip(x, block, bits)
    assert decoded.dtype == torch.float32 and decoded.shape == (n,)
    error = (decoded.double() - x.double()).abs()
    bound = quantization.error_bound(x, block, bits)
    assert (error <= bound).all(), float((error / bound).max())


@pytest.mark.parametrize("bits", quantization.BITS)
def test_the_bound_is_nearly_reached_so_it_says_something(bits):
    x = torch.linspace(-1, 1, 4096)
    error = (_roundtrip(x, 256, bits).double() - x.double()).abs()
    assert float((error / quantization.error_bound(x, 256, bits)).max()) > 0.9


def test_values_on_the_grid_and_zero_blocks_are_exact():
    block = 8
    grid = torch.arange(-124, 124, dtype=torch.float32) * 0.5  # multiples of max|x| / 127 = 0.5 in each block
    grid.view(-1, block)[:, 0] = 63.5  # every block's absmax, so its scale is 0.5
    assert torch.equal(_roundtrip(grid, block), grid)
    zeros = torch.zeros(40)
    assert torch.equal(_roundtrip(zeros, block), zeros)
    four = torch.arange(-7, 9, dtype=torch.float32).clamp(max=7) * 0.25  # int4: multiples of max|x| / 7 = 0.25
    assert torch.equal(_roundtrip(four, block, 4), four)


@pytest.mark.parametrize("bits", quantization.BITS)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_a_non_finite_value_makes_its_whole_block_nan_and_no_other(bad, bits):
    x = torch.randn(64)
    x[20] = bad
    decoded = _roundtrip(x, 16, bits)
    assert decoded[16:32].isnan().all()  # an overflow is never decoded into finite numbers
    assert decoded[:16].isfinite().all() and decoded[32:].isfinite().all()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 3), n=st.integers(1, 300), block=st.sampled_from([4, 16, 64]),
       slice_=st.sampled_from([1, 20, 64, 2**18]), seed=st.integers(0, 2**16), bad=st.booleans(),
       bits=st.sampled_from(quantization.BITS))
def test_slices_change_nothing_the_packets_are_the_whole_tensors(rows, n, block, slice_, seed, bad, bits):
    """Encoding and decoding a slice of blocks at a time (``SLICE`` elements, here down to one block) gives the
    packets and the values of the whole tensor computed in one go, bit for bit, row by row."""
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 3
    if bad:
        x[-1, n // 2] = math.inf
    whole = [_whole_packet(row, block, bits) for row in x]
    expected = [_decoded(packet, n, block, bits) for packet in whole]  # (SLICE is 2**18: one slice here)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quantization, "SLICE", slice_)
        packets = _encoded(x, block, bits)
        for r in range(rows):
            assert torch.equal(packets[r], whole[r])
            assert torch.equal(_decoded(packets[r], n, block, bits).nan_to_num(7.0), expected[r].nan_to_num(7.0))


def test_the_policy_checks_its_group_size(monkeypatch):
    assert Communication().group_size(6) == 6
    assert Communication(shard_size=3).group_size(6) == 3
    with pytest.raises(ValueError, match="shard_size=4 does not divide the world of 6 ranks"):
        Communication(shard_size=4).group_size(6)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Communication(shard_size="local").group_size(6) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE, which is not set"):
        Communication(shard_size="local").group_size(6)
    with pytest.raises(ValueError, match="at least 1"):
        Communication(shard_size=0)


@pytest.mark.parametrize("settings_,match", [
    ({"stage": 2, "communication": {"quantized_weights": True}}, "quantized_weights needs stage 3"),
    ({"stage": 0, "communication": {"quantized_gradients": True}}, "quantized_gradients needs stage 1, 2 or 3"),
    ({"stage": 0, "communication": {"shard_size": 2}}, "shard_size needs stage 1, 2 or 3"),
    ({"communication": {"shard_size": 2.0}}, "shard_size"),
    ({"communication": {"block_size": 8}}, "block_size"),
    ({"communication": {"quantized_weight": True}}, "quantized_weight"),
    ({"stage": 3, "communication": {"hierarchy": "hpz"}}, "hierarchy='hpz' needs shard_size"),
    ({"stage": 2, "communication": {"hierarchy": "hpz", "shard_size": 2}}, "hierarchy='hpz' needs stage 3"),
    ({"communication": {"hierarchy": "fsdp", "shard_size": 2}}, "hierarchy"),
])
def test_bad_communication_settings_are_refused_by_name(settings_, match):
    from zero import ZeroConfig

    with pytest.raises(ValueError, match=match):
        ZeroConfig(**settings_)


def test_shard_size_needs_the_default_process_group_and_a_divisible_world():
    from torch import nn

    from zero import ZeroOptimizer

    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="shard_size=2 does not divide the world of 1 ranks"):
        ZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, stage=2,
                      communication={"shard_size": 2})
