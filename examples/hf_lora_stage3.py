"""LoRA fine-tuning with the Hugging Face Trainer and PEFT at ZeRO stage 3.

    torchrun --standalone --nproc-per-node 2 examples/hf_lora_stage3.py --steps 20 --out lora-out
    python examples/hf_lora_stage3.py --steps 20 --out lora-out          # one process works too

The base model is a small GPT-2 built from a config with random weights, so nothing is downloaded: swap in
``AutoModelForCausalLM.from_pretrained(...)`` and your tokenized dataset for a real fine-tune. At stage 3 the
frozen base and the adapters are both sharded across the ranks; only the adapters get gradients and AdamW state.
Needs ``pip install transformers peft accelerate``.
"""

import argparse

import torch
from peft import LoraConfig, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from zero import ZeroConfig
from zero.integrations.transformers import ZeroTrainer

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--steps", type=int, default=20, help="optimizer steps")
p.add_argument("--layers", type=int, default=2)
p.add_argument("--d-model", type=int, default=64)
p.add_argument("--seq-len", type=int, default=32)
p.add_argument("--rank", type=int, default=8, help="LoRA rank r")
p.add_argument("--out", default="lora-out", help="output directory (the adapter goes to OUT/adapter)")
args = p.parse_args()


class Sequences(torch.utils.data.Dataset):
    """Stand-in for a tokenized corpus: arithmetic sequences of token ids (a pattern LoRA can learn quickly)."""

    def __init__(self, rows: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        start, stride = torch.randint(vocab, (rows, 1), generator=g), torch.randint(1, 4, (rows, 1), generator=g)
        self.ids = (start + stride * torch.arange(args.seq_len)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts the labels itself


# A tiny GPT-2 with random weights (in real use: AutoModelForCausalLM.from_pretrained("gpt2")).
torch.manual_seed(0)
base = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.d_model, n_head=4, vocab_size=128,
                                  n_positions=args.seq_len))
# LoRA on GPT-2's attention and MLP projections (Conv1D layers: fan_in_fan_out=True); the base is frozen.
model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=args.rank, lora_alpha=2 * args.rank,
                                        target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True))

training_args = TrainingArguments(
    output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
    learning_rate=1e-2, lr_scheduler_type="cosine", max_grad_norm=1.0,  # clipped globally by zero
    logging_steps=max(1, args.steps // 10), save_strategy="no", report_to="none", disable_tqdm=True,
    use_cpu=not torch.cuda.is_available(),
    # bf16=True is refused: use ZeroConfig(precision={"param_dtype": "bf16"}) instead
)
# ZeroTrainer = Trainer whose optimizer (AdamW over the trainable adapters) is wrapped in ZeroOptimizer, no DDP
trainer = ZeroTrainer(model=model, args=training_args, train_dataset=Sequences(256, 128),
                      zero_config=ZeroConfig(stage=3))
if trainer.args.should_save:
    model.print_trainable_parameters()
trainer.train()

# Export the adapter: at stage 3 each rank holds only shards, so gather the whole parameters (every rank
# enters the block), and let the main process write PEFT's adapter_config.json + adapter_model.safetensors.
opt = trainer.zero_optimizer
with opt.gathered_parameters():
    if trainer.args.should_save:
        model.save_pretrained(f"{args.out}/adapter")
        print(f"adapter saved to {args.out}/adapter (load: PeftModel.from_pretrained(base, '{args.out}/adapter'))")
# Full-model checkpoints for resuming: trainer.save_model() / save_strategy="steps" write zero's portable checkpoint.
opt.close()  # gives the model back whole (e.g. to merge_and_unload() the adapter into the base)
