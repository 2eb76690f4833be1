"""Short convolutions under CP: LFM2, LFM2-MoE, LFM3 (``*ShortConv``).

The layer projects its tokens to ``[B | C | x]``, convolves ``B * x`` causally and depthwise over the
sequence (a kernel of a few tokens), multiplies by ``C`` and projects out. The convolution is the only token
mixing, and it is per channel: ``B * x`` goes to the channels (``hidden / cp`` per rank, every token), the
convolution rows of those channels run on whole sequences through the modeling module's
``causal_conv1d_fn``, and the result comes back before ``C *``.

Sizes and split rule: :class:`~lightning_cp.hf.mixers.kinds.ShortConvShape`.
"""

from __future__ import annotations

from torch import Tensor, nn

from lightning_cp.hf.mixers._adapter import channel_rows, depthwise_conv, tokens
from lightning_cp.hf.mixers.kinds import ShortConvShape
from lightning_cp.parallel.head_parallel import for_each_sequence, head_slices, to_heads, to_tokens
from lightning_cp.parallel.shard import CPShard


class ShortConvAdapter:
    """The context-parallel forward of ``transformers``' ``*ShortConv`` layers: channels split over ranks."""

    def shape(self, module: nn.Module) -> ShortConvShape:
        return ShortConvShape(module.conv.in_channels)

    def forward(self, module: nn.Module, hidden_states: Tensor, shard: CPShard) -> Tensor:
        cp, rank = shard.split.cp_size, shard.split.cp_rank
        width = self.shape(module).channels // cp
        b, c, x = module.in_proj(hidden_states).chunk(3, dim=-1)
        # Rank r convolves the channels r * width .. (r + 1) * width.
        slices = head_slices(cp, cp, "channel blocks")
        (bx,) = to_heads(shard, (tokens(b * x, width), slices))
        rows = shard.device_index(channel_rows(slices[rank], width))

        def mix(bx: Tensor) -> Tensor:
            return depthwise_conv(module, module.conv, rows, None, bx)[0]

        y = to_tokens(shard, for_each_sequence(shard, mix, bx)).reshape(c.shape)
        return module.out_proj(c * y)


_SHORT_CONV = ShortConvAdapter()
ADAPTERS = {name: _SHORT_CONV for name in ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")}
"""The short-convolution adapter, by layer class name."""
