"""Codecs price themselves (issue 43): each ``zero.comm.codec.Codec`` states the bytes a collective puts on the wire and
what it holds (``gather_cost``, ``reduce_scatter_cost``, ``all_reduce_cost``), the estimator asks the codec that
``zero.comm.hierarchy.codec_of`` builds for the policy, and ``Communication`` names a codec of one's own by import path
(``gather_codec``, ``reduce_codec``), checked at the edge. One process; the test codecs (``tests.codecs``) run and
priced in real worlds: ``tests/distributed/test_codec_world.py``.

* ZeRO++'s codecs (qwZ, qgZ int8 and int4, and qgZ's sum across HSDP's groups) are priced per bucket exactly as the
  estimator priced them from the policy's flags before (the formulas below, and a few values pinned as computed
  then), in memory and on the wire;
* every codec's stated bytes on the wire are what its transport calls move;
* the policy refuses a path that does not import, names nothing or no codec, or a codec that cannot be built, each
  naming the cause and the fix; a codec and the flag it replaces together; a lossy gather codec below stage 3 and
  either codec at stage 0 (as qwZ and qgZ are refused); a reduction codec without an all-reduce under HSDP.
"""

from __future__ import annotations

import pytest
import torch

from tests.codecs import WIRE, Bf16WireCodec, Fp8Gather, fp8_packet
from zero import ZeroConfig
from zero.comm.codec import Codec, IdentityCodec, PerCollective, QuantizedGradients, QuantizedWeights, Works
from zero.comm.hierarchy import codec_of
from zero.comm.policy import Communication
from zero.comm.quantization import decode_bytes, packet_bytes, scratch_bytes
from zero.estimator.codec_memory import CodecMemory
from zero.estimator.traffic import Wire, step_traffic

CODECS = {"gather_codec": "tests.codecs:Fp8Gather", "reduce_codec": "tests.codecs:Bf16WireCodec"}
CHUNKS = (1, 7, 255, 256, 257, 1000, 2**18 + 5, 3 * 2**18 + 1)  # one block and less, a slice and more
LAYOUTS = ((2, 2), (3, 3), (2, 4), (4, 8), (8, 8))  # (the group the parameters are sharded over, world size)
POLICIES = (
    {"quantized_weights": True},
    {"quantized_gradients": True},
    {"quantized_gradients": True, "gradient_bits": 4, "block_size": 32},
    {"quantized_weights": True, "quantized_gradients": True, "block_size": 64},
)


# ----- the estimator's per-bucket codec bytes before issue 43, from the policy's flags ------------------------------


def _before(policy: Communication, group: int, world: int, w: Wire) -> dict:
    """What ``zero.estimator.codec_memory.CodecMemory`` priced from ``policy``'s flags before the codecs priced
    themselves (its formulas, as they were)."""
    block, bits, g = policy.block_size, policy.gradient_bits, w.padded // w.chunk
    weights, gradients = policy.quantized_weights and group > 1, policy.quantized_gradients and group > 1
    replicas = world // group if policy.quantized_gradients else 1
    grads = gradients and w.trainable

    def summing(n: int) -> int:
        return scratch_bytes(1, n, block) + decode_bytes(n, block, bits)

    sending = (g * packet_bytes(w.chunk, block, bits), scratch_bytes(g, w.chunk, block, bits)) if grads else (0, 0)
    across = (0, 0, 0, 0)
    if replicas > 1 and w.trainable:
        piece = -(-w.chunk // replicas)
        packet = packet_bytes(piece, block, bits)
        copies = 4 * (replicas + 1) * piece
        wait = max(summing(piece), packet + scratch_bytes(1, piece, block, bits),
                   (1 + replicas) * packet + decode_bytes(piece, block, bits))
        across = (copies + replicas * packet, scratch_bytes(replicas, piece, block, bits),
                  copies + 2 * replicas * packet, wait)
    return {
        "gathering": (1 + g) * packet_bytes(w.chunk, block) if weights else 0,
        "gather_decode": decode_bytes(w.chunk, block) if weights else 0,
        "sending": sending,
        "reducing": 2 * sending[0],
        "reduce_decode": summing(w.chunk) if grads else 0,
        "across": across,
    }


def _now(memory: CodecMemory, w: Wire) -> dict:
    return {"gathering": memory.gathering(w), "gather_decode": memory.gather_decode(w), "sending": memory.sending(w),
            "reducing": memory.reducing(w), "reduce_decode": memory.reduce_decode(w), "across": memory.across(w)}


def _policies():
    for flags in POLICIES:
        for group, world in LAYOUTS:
            hsdp = {"shard_size": group} if group < world else {}
            yield Communication(**flags, **hsdp), group, world


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_plus_plus_codecs_are_priced_per_bucket_as_the_policy_flags_priced_them(dtype):
    for policy, group, world in _policies():
        memory = CodecMemory.of(policy, group, world)
        for chunk in CHUNKS:
            for trainable in (True, False):
                w = Wire(group * chunk, chunk, dtype, torch.float32, trainable, "unit")
                assert _now(memory, w) == _before(policy, group, world, w), (policy, group, world, chunk, trainable)


def test_pinned_per_bucket_codec_bytes():
    """A few values as the flags' formulas gave them before the change (computed then, with the tree of that time)."""
    cases = (  # (policy, group, world, chunk, params dtype) -> gathering, gather_decode, sending, reducing,
        #   reduce_decode, across
        ({"quantized_weights": True}, 2, 2, 1000, torch.float32, (3120, 4096, (0, 0), 0, 0, (0,) * 4)),
        ({"quantized_gradients": True}, 3, 3, 257, torch.float32, (0, 0, (1560, 6144), 3120, 4096, (0,) * 4)),
        ({"quantized_gradients": True, "shard_size": 2}, 2, 4, 1000, torch.float32,
         (0, 0, (2080, 8192), 4160, 8192, (7040, 4096, 8080, 4096))),
        ({"quantized_gradients": True, "gradient_bits": 4, "shard_size": 2, "block_size": 32}, 2, 8, 2**18 + 5,
         torch.float32, (0, 0, (327720, 1572864), 655440, 2359296, (1474680, 1572864, 1638600, 590112))),
        ({"quantized_weights": True, "quantized_gradients": True, "block_size": 64}, 8, 8, 3 * 2**18 + 1,
         torch.bfloat16, (7520868, 1048576, (6685216, 1048576), 13370432, 2097152, (0,) * 4)),
    )
    for flags, group, world, chunk, dtype, expected in cases:
        w = Wire(group * chunk, chunk, dtype, torch.float32, True, "unit")
        assert tuple(_now(CodecMemory.of(Communication(**flags), group, world), w).values()) == expected, flags


def test_zero_plus_plus_traffic_is_priced_as_the_policy_flags_priced_it():
    wires = tuple(Wire(4 * c, c, torch.bfloat16, torch.float32, c != 7, "u" if c < 300 else "v") for c in CHUNKS)
    gathers = {"u": 3, "v": 2}
    for flags in POLICIES:
        policy = Communication(**flags, shard_size=4)
        block, bits = policy.block_size, policy.gradient_bits
        for stage in (1, 2, 3) if not policy.quantized_weights else (3,):
            got = step_traffic(stage, wires, 5, gathers, policy, 4, 8).comm_stats()
            trainable = [w for w in wires if w.trainable]
            if policy.quantized_gradients:
                packets = sum(4 * packet_bytes(w.chunk, block, bits) for w in trainable)
                across = sum(2 * 2 * packet_bytes(-(-w.chunk // 2), block, bits) for w in trainable)
            else:
                packets = sum(4 * w.chunk * 4 for w in trainable)
                across = sum(w.chunk * 4 for w in trainable)
            assert got["reduce_scatter"]["bytes"] == packets
            assert got["inter_all_reduce"]["bytes"] == across + 5 * 4 + 2 * 4 + (8 if stage == 3 else 0)
            if stage == 3:
                per_gather = (lambda w: 4 * packet_bytes(w.chunk, block)) if policy.quantized_weights else (
                    lambda w: 4 * w.chunk * 2)
                assert got["all_gather"]["bytes"] == sum(gathers[w.unit] * per_gather(w) for w in wires)


# ----- every codec's stated wire bytes are what it moves -------------------------------------------------------------


class CountingTransport:
    """Counts what a codec's transport calls move, as ``zero.comm.communicator.GroupTransport`` counts it (rank 0 of
    ``world_size``; outputs zeroed, works already complete)."""

    rank, device, backend = 0, torch.device("cpu"), "fake"

    def __init__(self, world_size: int):
        self.world_size, self.bytes = world_size, 0

    def _moved(self, counted: torch.Tensor, *outputs: torch.Tensor) -> Works:
        self.bytes += counted.nbytes
        for output in outputs:
            output.zero_()
        return Works([])

    def all_gather(self, output, input):
        return self._moved(output, output)

    def reduce_scatter(self, output, input):
        return self._moved(input, output)

    def all_to_all(self, output, input):
        return self._moved(input, output)

    def all_reduce(self, tensor):
        return self._moved(tensor)


CODEC_CASES = (IdentityCodec(), QuantizedWeights(64), QuantizedGradients(64), QuantizedGradients(32, bits=4),
               Fp8Gather(), Bf16WireCodec())


@pytest.mark.parametrize("codec", CODEC_CASES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_codecs_stated_wire_bytes_are_what_its_transport_calls_move(codec, dtype):
    for group in (2, 3):
        for n in (1, 7, 100):
            for kind, cost, run in (
                ("gather", codec.gather_cost,
                 lambda t: codec.all_gather(torch.zeros(group * n, dtype=dtype), torch.ones(n, dtype=dtype), t)),
                ("reduce_scatter", codec.reduce_scatter_cost,
                 lambda t: codec.reduce_scatter(torch.zeros(n, dtype=dtype), torch.ones(group * n, dtype=dtype), t)),
                ("all_reduce", codec.all_reduce_cost, lambda t: codec.all_reduce(torch.ones(n, dtype=dtype), t)),
            ):
                try:
                    stated = cost(n, group, dtype)
                except NotImplementedError:  # (a test codec prices only the collectives it runs)
                    continue
                transport = CountingTransport(group)
                run(transport).wait(None)
                assert stated.wire == transport.bytes, (kind, group, n)


def test_a_codec_that_does_not_price_a_collective_says_what_to_implement():
    with pytest.raises(NotImplementedError, match="implement gather_cost"):
        Codec().gather_cost(8, 2, torch.float32)
    with pytest.raises(NotImplementedError, match="implement all_reduce_cost"):
        Bf16WireCodec().all_reduce_cost(8, 2, torch.float32)


# ----- a codec of one's own, named by the policy ----------------------------------------------------------------------


def test_codec_of_builds_the_codecs_the_policy_names_and_is_unchanged_for_the_flags():
    assert repr(codec_of(Communication())) == "IdentityCodec()"
    assert repr(codec_of(Communication(quantized_weights=True, quantized_gradients=True, gradient_bits=4,
                                       block_size=64))) == (
        "PerCollective(gather=QuantizedWeights(block=64, bits=8), reduce=QuantizedGradients(block=64, bits=4))")
    both = codec_of(Communication(**CODECS))
    assert isinstance(both, PerCollective) and not both.exact_gather
    assert isinstance(both.gather, Fp8Gather) and isinstance(both.reduce, Bf16WireCodec)
    gather = codec_of(Communication(gather_codec="tests.codecs:Fp8Gather", quantized_gradients=True))
    assert repr(gather) == "PerCollective(gather=Fp8Gather(), reduce=QuantizedGradients(block=256, bits=8))"


def test_the_estimator_prices_a_policy_codec_by_asking_it():
    policy = Communication(**CODECS)
    wires = tuple(Wire(2 * c, c, torch.bfloat16, torch.float32, True, "u") for c in (7, 1000))
    got = step_traffic(3, wires, 2, {"u": 3}, policy, 2, 2)
    rows = {(c.kind, c.dtype): c for c in got.collectives}
    assert rows["all_gather", "fp8"].bytes == 3 * sum(2 * fp8_packet(w.chunk) for w in wires)
    assert rows["reduce_scatter", "bf16"].bytes == sum(w.padded * WIRE.itemsize for w in wires)
    memory = CodecMemory.of(policy, 2, 2)
    for w in wires:
        assert memory.gathering(w) == 3 * fp8_packet(w.chunk) and memory.gather_decode(w) == 4 * w.chunk
        assert memory.sending(w) == (2 * w.padded, 0) and memory.reducing(w) == 4 * w.padded  # (fp32 into bf16)
        assert memory.reduce_decode(w) == 4 * 3 * w.chunk


@pytest.mark.parametrize("path,message", [
    ("tests.codecs.Fp8Gather", r"is not an import path: give 'module:Class'"),
    ("tests.no_such_module:Fp8Gather", r"module 'tests.no_such_module' does not import \(ModuleNotFoundError.*"
                                       r"PYTHONPATH"),
    ("tests.codecs:NoSuchCodec", r"module 'tests.codecs' has no 'NoSuchCodec'; check the class's name"),
    ("tests.codecs:fp8_packet", r"not a zero.comm.codec.Codec subclass: subclass Codec"),
    ("zero.comm.codec:QuantizedWeights", r"cannot be built with no arguments .*give its parameters defaults"),
])
def test_the_policy_refuses_a_codec_path_naming_the_cause_and_the_fix(path, message):
    with pytest.raises(ValueError, match=rf"communication.gather_codec='{path}'.*{message}"):
        Communication(gather_codec=path)
    with pytest.raises(ValueError, match=r"communication.reduce_codec="):
        ZeroConfig(stage=2, communication={"reduce_codec": path})


@pytest.mark.parametrize("stage,policy,message", [
    (2, {"gather_codec": "tests.codecs:Fp8Gather"},
     r"gather_codec='tests.codecs:Fp8Gather' \(lossy: exact_gather=False\) needs stage 3 \(got stage 2\)"),
    (0, {"reduce_codec": "tests.codecs:Bf16WireCodec"}, r"reduce_codec needs stage 1, 2 or 3 \(got stage 0\)"),
    (0, {"gather_codec": "zero.comm.codec:IdentityCodec"}, r"gather_codec needs stage 1, 2 or 3 \(got stage 0\)"),
    (3, {"gather_codec": "tests.codecs:Fp8Gather", "quantized_weights": True},
     r"gather_codec and quantized_weights both choose the codec of the same collectives: set one"),
    (2, {"reduce_codec": "tests.codecs:Bf16WireCodec", "quantized_gradients": True},
     r"reduce_codec and quantized_gradients both"),
    (2, {"reduce_codec": "tests.codecs:Bf16WireCodec", "shard_size": 2},
     r"does not implement all_reduce, with which HSDP \(shard_size\) sums each gradient shard across the groups"),
])
def test_the_policy_refuses_codecs_where_the_flags_they_replace_are_refused(stage, policy, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig(stage=stage, communication=policy)


def test_codecs_run_where_the_flags_they_replace_run():
    ZeroConfig(stage=3, communication=CODECS)
    ZeroConfig(stage=1, communication={"reduce_codec": "tests.codecs:Bf16WireCodec"})
    ZeroConfig(stage=2, communication={"gather_codec": "zero.comm.codec:IdentityCodec"})  # exact: stages 1-3
    assert Communication(**CODECS).model_dump(exclude_defaults=True) == CODECS  # (a plain string: JSON as it is)
    assert not Communication(**CODECS).exact_gathers and Communication(quantized_gradients=True).exact_gathers
