"""A small GPT-style language model for the demo, the tests and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, head_dim)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                 nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, and an LM head tied to the token embedding."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.wte.weight
        self.register_buffer("positions", torch.arange(cfg.seq_len), persistent=False)
        self.apply(init_gpt_weights)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(self.positions[:t])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def init_gpt_weights(module: nn.Module) -> None:
    """GPT-2's initialization: N(0, 0.02) weights, zero biases, unit LayerNorm; applied with
    ``model.apply`` at construction, and the ``init_fn`` that rebuilds it from the meta device
    (which also needs the ``positions`` buffer made again)."""
    if isinstance(module, GPT):
        module.positions = torch.arange(module.cfg.seq_len, device=module.wte.weight.device)
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def synthetic_batch(step: int, batch_size: int, cfg: GPTConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch of random tokens for ``step`` (same on every rank)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def local_slice(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal share of a global batch (the batch must divide evenly)."""
    if batch.shape[0] % world_size:
        raise ValueError(f"global batch {batch.shape[0]} does not split evenly over {world_size} ranks")
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style GPT (separate q/k/v projections, no position embedding) that torch's tensor parallelism splits
    by heads; ``qk_norm``: a norm over each head's queries and keys (Qwen3's)."""

    vocab_size: int = 256
    seq_len: int = 32
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    qk_norm: bool = False
    tie_embeddings: bool = False  # the output head is the token embedding (GPT-2's, Llama 3.2 1B's)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.num_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))
        self.q_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # heads: -1, so that a tp rank holding some of them computes those
        q = self.q_norm(self.wq(x).view(b, t, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(b, t, -1, self.head_dim))
        v = self.wv(x).view(b, t, -1, self.head_dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.d_model)
        self.attention = LlamaAttention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.feed_forward = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                          nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class LlamaGPT(nn.Module):
    """Token embedding, pre-norm :class:`LlamaBlock` s, a final norm and an output head (untied unless
    ``cfg.tie_embeddings``)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(init_gpt_weights)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(self(idx), targets)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross entropy of ``(batch, seq, vocab)`` logits (a pipeline schedule's ``loss_fn``)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LlamaPart(nn.Module):
    """A run of consecutive blocks of a :class:`LlamaGPT` (the first part also its embedding, the last its norm and
    head) under the whole model's names (``layers.3.attention.wq.weight``), as torchtitan cuts a model for pipeline
    parallelism: a part's checkpoint names are the whole model's."""

    def __init__(self, model: LlamaGPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x)) if self.output is not None else x


def pipeline_parts(model: LlamaGPT, num_parts: int) -> list[LlamaPart]:
    """``model`` cut into ``num_parts`` :class:`LlamaPart` s of consecutive blocks (as even as they divide; the
    modules are shared with ``model``, not copied): part ``i`` is pipeline stage ``i``."""
    n = len(model.layers)
    if not 1 <= num_parts <= n:
        raise ValueError(f"cannot cut {n} blocks into {num_parts} pipeline parts (1 to {n})")
    bounds = [n * i // num_parts for i in range(num_parts + 1)]
    return [LlamaPart(model, range(bounds[i], bounds[i + 1]), i == 0, i == num_parts - 1) for i in range(num_parts)]


def tensor_parallel_plan(model: LlamaGPT, sequence_parallel: bool, qk_norm_declared: bool = True) -> dict:
    """torch's parallel styles for :class:`LlamaGPT` (``parallelize_module(model, mesh["tp"], plan)``): attention by
    heads and the MLP by its hidden units; with ``sequence_parallel``, torchtitan's Llama plan (the embedding row-wise
    to sequence shards, the norms ``SequenceParallel``, the blocks' inputs gathered by ``PrepareModuleInput``).
    ``qk_norm_declared``: per-head q/k norms ``SequenceParallel`` over the head dimension (their weights replicated
    DTensors whose gradients torch sums over tp); else left plain parameters."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {}
    if sequence_parallel:
        plan |= {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                 "norm": SequenceParallel(),
                 "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(model.layers)):
        at = f"layers.{i}."
        plan |= {at + name: ColwiseParallel() for name in ("attention.wq", "attention.wk", "attention.wv",
                                                            "feed_forward.0")}
        plan |= {at + "attention.wo": RowwiseParallel(output_layouts=out),
                 at + "feed_forward.2": RowwiseParallel(output_layouts=out)}
        if sequence_parallel:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan |= {at + "attention_norm": SequenceParallel(), at + "ffn_norm": SequenceParallel(),
                     at + "attention": gather, at + "feed_forward": gather}
        if model.cfg.qk_norm and qk_norm_declared:
            plan |= {at + f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                     for n in ("q_norm", "k_norm")}
    return plan
