"""A small GPT-style decoder that runs under context parallelism, for examples and tests.

Pre-norm blocks (RMSNorm, causal self-attention, GELU MLP), rotary position embeddings driven by
``position_ids`` (so a CP shard, whose tokens are not contiguous, rotates each token by its true
position), :func:`lightning_cp.parallel.context_parallel_attention`, and an LM head whose weight is
exposed (``lm_head_weight``) so the loss can fuse the head matmul instead of materializing logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_cp.parallel.attention import context_parallel_attention
from lightning_cp.parallel.shard import CPShard


@dataclass(frozen=True)
class GPTConfig:
    """Size of the decoder."""

    vocab_size: int = 32768
    """Number of token ids (embedding rows and LM-head outputs)."""
    n_layer: int = 2
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block."""
    n_embd: int = 128
    """Hidden size; must be divisible by ``n_head`` and give an even head size (RoPE rotates pairs)."""
    mlp_ratio: int = 4
    """MLP inner size as a multiple of ``n_embd``."""
    rope_base: float = 10000.0
    """Base of the rotary frequencies."""
    tie_embeddings: bool = True
    """Use the token embedding as the LM head (``lm_head_weight`` is then the embedding matrix)."""

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"n_embd={self.n_embd} must be divisible by n_head={self.n_head} into an even head size."
            )


# Checkpoints store the config among the hyperparameters; let ``torch.load(weights_only=True)`` read it back.
torch.serialization.add_safe_globals([GPTConfig])


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to ``x`` [B, heads, S, D] with per-token ``cos``/``sin`` [B, 1, S, D/2] (rotate-half form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, shard: CPShard | None) -> Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_head, width // self.n_head).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = context_parallel_attention(q, k, v, cp_shard=shard)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, width))


class _Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.n_embd)
        self.attn = _Attention(config)
        self.mlp_norm = nn.RMSNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, config.mlp_ratio * config.n_embd, bias=False),
            nn.GELU(),
            nn.Linear(config.mlp_ratio * config.n_embd, config.n_embd, bias=False),
        )

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, shard: CPShard | None) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, shard)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder returning final hidden states; pair it with ``lm_head_weight`` and a fused loss.

    Args:
        config: sizes, see :class:`GPTConfig`.
    """

    _no_split_modules = ("_Block",)
    """Module classes kept whole by sharding wrappers (as Hugging Face models declare): the default FSDP units."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd)
        self.lm_head = (
            None if config.tie_embeddings else nn.Linear(config.n_embd, config.vocab_size, bias=False)
        )
        head_dim = config.n_embd // config.n_head
        inv_freq = config.rope_base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    @property
    def lm_head_weight(self) -> Tensor:
        """``[vocab_size, n_embd]``: the output projection (the embedding when tied)."""
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: Tensor, position_ids: Tensor, *, cp_shard: CPShard | None = None) -> Tensor:
        """Hidden states of this rank's tokens.

        Args:
            input_ids: ``[B, S_local]`` int64, this rank's tokens (``shard_batch`` layout).
            position_ids: ``[B, S_local]`` int64, each token's position in its sequence (drives RoPE).
            cp_shard: the batch's ``batch["cp_shard"]``, which carries its CP group (required for packed
                batches and under CP; without it every row is one causal sequence).

        Returns:
            ``[B, S_local, n_embd]`` after the final norm.
        """
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        x = self.embed(input_ids)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin, cp_shard)
        return self.norm(x)
