"""Plain-PyTorch references on materialized fp32 logits: what every chunked loss path must reproduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100


def make_case(
    n: int,
    hidden_size: int,
    vocab: int,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    ignore_every: int = 5,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hidden [n, H]``, ``weight [V, H]`` (leaves requiring grad) and ``labels [n]`` with every
    ``ignore_every``-th label ignored; logits have a spread of a few units, like a trained head."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g)
    weight = torch.randn(vocab, hidden_size, generator=g) * (2.0 / hidden_size**0.5)
    labels = torch.randint(0, vocab, (n,), generator=g)
    if ignore_every:
        labels[::ignore_every] = IGNORE
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels


def make_bias(vocab: int, dtype: torch.dtype = torch.float32, *, seed: int = 2) -> torch.Tensor:
    """An LM-head bias ``[V]`` (a leaf requiring grad) of the logits' spread, so dropping it shows."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g).to(dtype).requires_grad_()


def upcast_leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """fp32 leaf copies (requiring grad) of the given inputs, for a reference that does not round."""
    return [t.detach().float().requires_grad_() for t in tensors]


def head_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    softcap: float | None = None,
    temperature: float = 1.0,
    *,
    bias: torch.Tensor | None = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """``softcap(logit_scale * (hidden @ weight.T + bias)) / temperature`` in fp32, written out."""
    z = (hidden @ weight.t()).float()
    if bias is not None:
        z = z + bias.float()
    return transform(z, softcap, temperature, logit_scale=logit_scale)


def transform(
    z: torch.Tensor, softcap: float | None = None, temperature: float = 1.0, *, logit_scale: float = 1.0
) -> torch.Tensor:
    z = z.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def cross_entropy(
    z: torch.Tensor,
    labels: torch.Tensor,
    *,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` plus ``z_loss * logsumexp(z)^2`` per valid token, reduced the same way."""
    loss = F.cross_entropy(
        z, labels, ignore_index=IGNORE, reduction=reduction, label_smoothing=label_smoothing
    )
    if z_loss:
        valid = labels != IGNORE
        extra = z_loss * torch.where(valid, torch.logsumexp(z, dim=-1).square(), 0.0)
        if reduction == "none":
            loss = loss + extra
        elif reduction == "sum":
            loss = loss + extra.sum()
        else:
            loss = loss + extra.sum() / valid.sum()
    return loss


def logprobs_and_entropy(z: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(z)[label]`` and the softmax entropy, both 0 at ignored tokens."""
    valid = labels != IGNORE
    logp = F.log_softmax(z, dim=-1)
    picked = logp.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
    entropy = torch.special.entr(logp.exp()).sum(-1)
    return torch.where(valid, picked, 0.0), torch.where(valid, entropy, 0.0)


def token_stats(z: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The :class:`~lightning_cp.ops.TokenStats` fields computed the obvious way."""
    z = z.detach()
    valid = labels != IGNORE
    nll = F.cross_entropy(z, labels, ignore_index=IGNORE, reduction="none")
    _, entropy = logprobs_and_entropy(z, labels)
    return {
        "nll": nll,
        "correct": (z.argmax(dim=-1) == labels) & valid,
        "entropy": entropy,
        "valid": valid,
    }


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32) -> None:
    """Compare a result with the fp32 reference; ``dtype`` is the precision of the inputs.

    fp32: every element within ``2e-5`` (relative and absolute).

    bf16 / fp16 (the inputs and logits were rounded, the reference was not): the whole tensor within
    0.75% in norm, ``||actual - expected|| <= 7.5e-3 ||expected||``, which a 1% systematic error fails
    (correct bf16 paths stay within 0.3% for gradients, 0.6% for per-token losses); and every element within 2% of its reference value plus 5% of
    the reference's root mean square, which a few elements far off fail.
    """
    actual, expected = actual.detach().float(), expected.detach().float()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-5, atol=2e-5)
        return
    ref_norm = torch.linalg.vector_norm(expected)
    error = torch.linalg.vector_norm(actual - expected)
    assert error <= 7.5e-3 * ref_norm, (
        f"relative error {(error / ref_norm).item():.3%} of the norm > 0.75% (||ref|| = {ref_norm.item():.4g})"
    )
    rms = ref_norm / max(expected.numel(), 1) ** 0.5
    torch.testing.assert_close(actual, expected, rtol=2e-2, atol=5e-2 * rms.item())
