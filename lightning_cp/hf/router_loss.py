"""The mixture-of-experts load-balancing loss of ``transformers`` over the whole global batch.

``transformers``' ``load_balancing_loss_func`` (Switch Transformer, equations 4-6; shared by Mixtral,
Qwen-MoE, OLMoE, gpt-oss, Granite-MoE, ...) is a function of per-expert statistics summed over every token
of the batch: how many times each expert is among a token's ``top_k`` choices, and each expert's summed
router probability, divided by the number of tokens. Each CP rank holds only its shard (and each DP rank
its rows), so the sums are all-reduced over the loss group before the loss is formed: it is then the
unsharded model's aux loss of the global batch, on every rank, and its gradient reaches each rank's own
router logits (the other ranks' sums enter as constants, and DDP's averaging adds the ranks' parts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_cp.parallel.layout import ProcessGroup


def load_balancing_loss(
    router_logits: Sequence[Tensor],
    num_experts: int,
    top_k: int,
    token_mask: Tensor,
    group: ProcessGroup | None,
) -> Tensor:
    """``num_experts * sum_e f_e * P_e`` over the tokens of every rank of ``group``, as ``transformers`` computes it.

    ``f_e`` is the fraction of (token, choice) pairs routed to expert ``e`` (``top_k`` per token, from the
    softmax of the router logits), ``P_e`` the mean router probability of ``e``; both are taken over the
    tokens where ``token_mask`` is set and over all layers, as ``load_balancing_loss_func`` does with an
    attention mask. Padding and the padding CP adds are excluded by passing ``batch["input_mask"]``.

    Args:
        router_logits: one ``[T_local, num_experts]`` tensor per MoE layer (the decoder's
            ``router_logits`` output with ``output_router_logits=True``), rows in the order of the batch's
            tokens flattened.
        num_experts: experts per layer.
        top_k: experts chosen per token.
        token_mask: ``[B, S_local]`` (any shape with ``T_local`` elements), true on real tokens.
        group: the ranks whose tokens form the batch (``layout.loss_group``: DP x CP), or ``None``.

    Returns:
        The fp32 scalar loss, identical on every rank of ``group``; its gradient flows to this rank's
        ``router_logits``.

    Communication: one all-reduce of ``2 * num_experts + 1`` floats over ``group``.

    Raises:
        ValueError: no router logits, or logits that are not ``[T_local, num_experts]``.
    """
    mask = token_mask.reshape(-1).to(torch.float32)
    if not router_logits:
        raise ValueError(
            "load_balancing_loss got no router logits: call the decoder with output_router_logits=True "
            "(a mixture-of-experts model returns one [tokens, experts] tensor per MoE layer)."
        )
    counts = mask.new_zeros(num_experts)
    probabilities = mask.new_zeros(num_experts)
    rows = mask.new_zeros(())
    for logits in router_logits:
        if logits.shape != (mask.numel(), num_experts):
            raise ValueError(
                f"router logits of shape {tuple(logits.shape)} do not match the {mask.numel()} tokens and "
                f"{num_experts} experts of the batch: expected [{mask.numel()}, {num_experts}]."
            )
        weights = F.softmax(logits.float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices
        counts = counts.scatter_add(0, chosen.reshape(-1), mask.repeat_interleave(top_k))
        probabilities = probabilities + (weights * mask[:, None]).sum(0)
        rows = rows + mask.sum()
    if group is not None:
        totals = torch.cat([counts, probabilities.detach(), rows[None]])
        dist.all_reduce(totals, group=group)
        counts, rows = totals[:num_experts], totals[-1]
        # The other ranks' probability sums are constants here; this rank's keep their gradient.
        probabilities = probabilities + (totals[num_experts:-1] - probabilities.detach())
    rows = rows.clamp(min=1)
    return num_experts * torch.sum((counts / rows) * (probabilities / rows))
