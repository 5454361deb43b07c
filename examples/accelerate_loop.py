"""A plain training loop with Hugging Face Accelerate and ZeroOptimizer (zero.integrations.accelerate.prepare).

    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --stage 2 --save acc-ckpt
    python examples/accelerate_loop.py --stage 3 --steps 40 --resume acc-ckpt     # one process, another stage
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # GPUs

The model is zero's small GPT on random tokens; any nn.Module and DataLoader go the same way.
Needs ``pip install accelerate``.
"""

import argparse

import torch
from accelerate import Accelerator

import zero.integrations.accelerate as zacc
from zero.models import GPT, GPTConfig

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=2)
p.add_argument("--steps", type=int, default=20, help="optimizer steps (each of 2 accumulated micro-batches)")
p.add_argument("--save", metavar="DIR", help="accelerator.save_state(DIR) at the end")
p.add_argument("--resume", metavar="DIR", help="accelerator.load_state(DIR) first (any world size and stage)")
args = p.parse_args()

# Accelerate's mixed_precision is refused: pass precision={"param_dtype": "bf16"} to prepare() instead.
# cpu=True without a GPU: otherwise, under torchrun, Accelerate treats each CPU rank as a separate single process.
accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=64, num_layers=2, num_heads=4)
torch.manual_seed(0)
model = GPT(cfg)
tokens = torch.randint(0, cfg.vocab_size, (256, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4,
                                     shuffle=True, generator=torch.Generator().manual_seed(0))

# prepare() wraps AdamW in ZeroOptimizer (keyword arguments are ZeroConfig fields), places the model WITHOUT DDP,
# makes accelerator.accumulate() skip communication on the first micro-batches, and prepares the data loader.
model, opt, loader = zacc.prepare(accelerator, model, torch.optim.AdamW(model.parameters(), lr=3e-3), loader,
                                  stage=args.stage)
# Build the scheduler on the optimizer prepare() returned (one built on the plain AdamW is refused).
scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s / 100)))


class Progress:
    """The step count, saved and loaded with the rest of the state (accelerator.register_for_checkpointing)."""

    step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


progress = Progress()
accelerator.register_for_checkpointing(progress)
if args.resume:  # the helper's hook loads zero's portable checkpoint from DIR/zero_checkpoint
    accelerator.load_state(args.resume)
    accelerator.print(f"resumed from {args.resume} at step {progress.step}")
    # (a real script would also skip the batches already seen: accelerator.skip_first_batches)

step = progress.step
while step < args.steps:
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = model.loss(x, y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = opt.clip_grad_norm_(1.0)  # the global norm; not accelerator.clip_grad_norm_
            opt.step()  # acts only on the last micro-batch of each step
            scheduler.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            step += 1
            mean = accelerator.reduce(loss.detach(), "mean").item()
            accelerator.print(f"step {step}/{args.steps} | loss {mean:.4f} | grad norm {norm:.3f} | "
                              f"lr {scheduler.get_last_lr()[0]:.2e} | model state/rank "
                              f"{opt.model_state_bytes().total / 2**20:.2f} MiB")
            if step == args.steps:
                break

progress.step = step
if args.save:  # every rank: model and optimizer go to DIR/zero_checkpoint through the helper's hook
    accelerator.save_state(args.save)
    accelerator.print(f"saved state to {args.save}")
accelerator.end_training()
