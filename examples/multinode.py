"""Two machines, as users launch them: hierarchical sharding along the machine boundary, optionally with ZeRO++'s
quantized communication. On each machine (here: two agents on this one, in two terminals or with ``&``):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 --rdzv-id demo \\
        examples/multinode.py --quantized

``communication={"shard_size": "local"}`` shards each bucket over the ranks of one machine (torchrun's
``LOCAL_WORLD_SIZE``) and replicates it across machines: parameters are gathered inside a machine only, and each
gradient shard crosses machines once, as one all-reduce of ``1/shard_size`` of the model. Every rank prints one
JSON line (its machine, its shard group, its losses and the bytes it sent per step, inside a machine and across);
with ``--check`` rank 0 also trains the same model in one process and prints the largest relative loss gap.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

from zero import ZeroOptimizer
from zero.models import GPT, GPTConfig, local_slice, synthetic_batch

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
p.add_argument("--steps", type=int, default=6)
p.add_argument("--quantized", action="store_true", help="also quantize weights (stage 3) and gradients to int8")
p.add_argument("--check", action="store_true", help="rank 0: compare the losses with one process's")
args = p.parse_args()

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_layers=2, num_heads=2)
GLOBAL_BATCH = 8


def train(rank: int, world_size: int, communication: dict | None) -> tuple[list[float], ZeroOptimizer | None]:
    torch.manual_seed(0)
    model = GPT(CFG)
    adamw = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt = ZeroOptimizer(adamw, model, stage=args.stage, communication=communication) if communication else adamw
    losses = []
    for step in range(args.steps):
        x, y = synthetic_batch(step % 3, GLOBAL_BATCH, CFG)
        x, y = local_slice(x, rank, world_size), local_slice(y, rank, world_size)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if communication:
            dist.all_reduce(total)  # (the global mean, for the log)
        losses.append(float(total) / world_size)
    return losses, opt if communication else None


dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
rank, world = dist.get_rank(), dist.get_world_size()
if torch.cuda.is_available():
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
communication = {"shard_size": "local"}
if args.quantized:
    communication.update(quantized_gradients=True, quantized_weights=args.stage == 3)
losses, opt = train(rank, world, communication)
report = {
    "rank": rank, "machine": int(os.environ["GROUP_RANK"]), "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
    "shard_group": dist.get_process_group_ranks(opt.comm.group), "losses": losses,
    "bytes_inside": sum(v["bytes"] for k, v in opt.comm_stats.items() if not k.startswith("inter_")),
    "bytes_across": sum(v["bytes"] for k, v in opt.comm_stats.items() if k.startswith("inter_")),
    "comm_stats": opt.comm_stats,
}
if args.check and rank == 0:
    reference, _ = train(0, 1, None)
    report["reference_gap"] = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
# One write per line: the ranks of a machine share its stdout, and print() writes the text and its newline
# separately when Python is unbuffered (PYTHONUNBUFFERED), so two ranks' lines could run together.
sys.stdout.write(json.dumps(report) + "\n")
sys.stdout.flush()
opt.close()
dist.barrier()  # (rank 0 checked alone: no rank tears its groups down while another still uses them)
dist.destroy_process_group()
