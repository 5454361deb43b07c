"""nanoGPT-style character-level training with ZeroOptimizer.

    torchrun --standalone --nproc-per-node 2 examples/nanogpt.py --stage 3 --steps 200 --save ckpt/
    torchrun --standalone --nproc-per-node 1 examples/nanogpt.py --stage 1 --steps 300 --resume ckpt/   # any world size

gloo on CPU, NCCL (one GPU per rank) when CUDA is available. The corpus is embedded below: no download.
Every rank samples the same *global* batch each step and trains on its slice, so a run resumed on another
world size sees the same data it would have seen without stopping.
"""

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

import zero
from zero.models import GPT, GPTConfig, local_slice

# A small public-domain corpus (Shakespeare, Sonnet 18 and Hamlet III.1), repeated to make a training set.
TEXT = """Shall I compare thee to a summer's day?
Thou art more lovely and more temperate:
Rough winds do shake the darling buds of May,
And summer's lease hath all too short a date;
Sometime too hot the eye of heaven shines,
And often is his gold complexion dimm'd;
And every fair from fair sometime declines,
By chance or nature's changing course untrimm'd;
But thy eternal summer shall not fade,
Nor lose possession of that fair thou ow'st;
Nor shall death brag thou wander'st in his shade,
When in eternal lines to time thou grow'st:
So long as men can breathe or eyes can see,
So long lives this, and this gives life to thee.
To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd. To die, to sleep;
To sleep: perchance to dream: ay, there's the rub;
For in that sleep of death what dreams may come
When we have shuffled off this mortal coil,
Must give us pause.
""" * 8

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2, help="ZeRO stage")
p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: bf16 compute, fp32 master shard")
p.add_argument("--offload", choices=["none", "cpu"], default="none",
               help="cpu: optimizer state and master weights in host memory (stages 1-3; stage 3 also the parameters)")
p.add_argument("--checkpointing", choices=["off", "on"], default="off", help="activation checkpointing of every block")
p.add_argument("--steps", type=int, default=200, help="train until this global step")
p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences), split over the ranks")
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--d-model", type=int, default=128)
p.add_argument("--heads", type=int, default=4)
p.add_argument("--seq-len", type=int, default=64)
p.add_argument("--log-interval", type=int, default=10)
p.add_argument("--save", metavar="DIR", help="save a portable checkpoint here at the end (every rank writes its part)")
p.add_argument("--resume", metavar="DIR", help="resume from a checkpoint saved at any world size and stage")
p.add_argument("--sample", type=int, default=200, help="characters to generate at the end (0: none)")
args = p.parse_args()
if args.offload == "cpu" and args.stage == 0:
    p.error("--offload cpu needs --stage 1, 2 or 3 (stage 0 keeps everything on every rank)")

# ----- distributed set-up: torchrun sets RANK/WORLD_SIZE/LOCAL_RANK -----
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
if args.batch_size % world:
    p.error(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")
say = print if rank == 0 else (lambda *a, **k: None)

# ----- data: characters -> token ids -----
chars = sorted(set(TEXT))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in TEXT], dtype=torch.long)


def get_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (the same on every rank and every world size)."""
    g = torch.Generator().manual_seed(step)
    starts = torch.randint(len(data) - args.seq_len - 1, (args.batch_size,), generator=g)
    x = torch.stack([data[s : s + args.seq_len] for s in starts])
    y = torch.stack([data[s + 1 : s + args.seq_len + 1] for s in starts])
    return local_slice(x, rank, world).to(device), local_slice(y, rank, world).to(device)


# ----- model and ZeroOptimizer -----
torch.manual_seed(0)  # same initial weights everywhere (ZeroOptimizer also broadcasts rank 0's)
cfg = GPTConfig(vocab_size=len(chars), seq_len=args.seq_len, d_model=args.d_model, num_layers=args.layers,
                num_heads=args.heads)
model = GPT(cfg).to(device)
n_params = sum(q.numel() for q in model.parameters())  # before stage 3 shards them
offload = {"optimizer": "cpu", "params": "cpu" if args.stage == 3 else "none"} if args.offload == "cpu" else {}
opt = zero.ZeroOptimizer(
    torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95)), model,
    stage=args.stage,
    precision={"param_dtype": "bf16"} if args.precision == "bf16" else {},  # {}: full precision
    offload=offload,  # {}: nothing offloaded
    activation_checkpointing={"every": 1} if args.checkpointing == "on" else None,
)
# warm-up then cosine decay; built on the ZeroOptimizer so it drives the sharded optimizer
warmup = max(1, args.steps // 10)
sched = torch.optim.lr_scheduler.LambdaLR(
    opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

start = 0
if args.resume:  # restores weights, AdamW state, scheduler, and our `extra`, whatever world size saved it
    extra = zero.load_checkpoint(args.resume, model, opt, scheduler=sched)
    start = extra["step"]
    say(f"resumed from {args.resume} at step {start} (saved by {extra['world_size']} ranks, now {world})")
say(f"GPT {n_params / 1e6:.2f}M params, vocab {len(chars)} | stage {args.stage}, {args.precision}, "
    f"offload {args.offload}, checkpointing {args.checkpointing} | {world} rank(s) on {device.type}, "
    f"global batch {args.batch_size}x{args.seq_len}")

# ----- training loop -----
t0, tokens = time.perf_counter(), 0
for step in range(start, args.steps):
    x, y = get_batch(step)
    loss = model.loss(x, y)
    opt.backward(loss)  # = loss.backward() in fp32/bf16; scales the loss under fp16
    norm = opt.clip_grad_norm_(1.0)  # the global norm over every rank's shard
    opt.step()
    opt.zero_grad()
    sched.step()
    tokens += args.batch_size * args.seq_len
    if (step + 1) % args.log_interval == 0 or step + 1 == args.steps:
        mean_loss = loss.detach().float()
        dist.all_reduce(mean_loss)  # mean over the ranks = loss of the global batch
        dt = time.perf_counter() - t0
        mem = opt.model_state_bytes()  # this rank: parameters, gradients, optimizer state (incl. masters)
        mib = 2**20
        gpu = f" | cuda peak {torch.cuda.max_memory_allocated() / mib:.1f} MiB" if cuda else ""
        say(f"step {step + 1:5d}/{args.steps} | loss {mean_loss.item() / world:.4f} | grad norm {norm:.3f} | "
            f"{tokens / dt:,.0f} tok/s | model state/rank {mem.total / mib:.2f} MiB (params "
            f"{mem.parameters / mib:.2f}, grads {mem.gradients / mib:.2f}, optim {mem.optimizer_state / mib:.2f}){gpu}",
            flush=True)
        t0, tokens = time.perf_counter(), 0

if args.save:  # every rank writes its own part; loads at any world size, stage, precision or offload
    zero.save_checkpoint(args.save, model, opt, scheduler=sched, extra={"step": args.steps, "world_size": world},
                         progress=rank == 0)
    say(f"saved step {args.steps} to {args.save}")

if args.sample:  # every rank runs the same generation (stage 3 gathers each block in turn)
    g = torch.Generator().manual_seed(1)
    idx = torch.tensor([[stoi["\n"]]], device=device)
    with torch.no_grad():
        for _ in range(args.sample):
            logits = model(idx[:, -args.seq_len :])[0, -1].float().cpu()
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g).to(device)
            idx = torch.cat([idx, nxt[None]], dim=1)
    say("sample:\n" + "".join(chars[i] for i in idx[0].tolist()))

opt.close()
dist.destroy_process_group()
