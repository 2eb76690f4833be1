"""What each kind of token mixer is, written once: its sizes, the rule by which they split over CP ranks, and
what one layer costs in the memory plan.

A :class:`MixerShape` is one layer's description. Its adapter reads it from the module
(:meth:`~lightning_cp.hf.mixers._adapter.MixerAdapter.shape`) and runs its forward with those sizes; the setup
checks ask it whether the heads split (:func:`~lightning_cp.hf.mixers.check_token_mixers_split`, also on a
``meta`` build before launch); the memory plan counts the layer's saved tensors and exchange with it
(:class:`lightning_cp.plan.shape.TokenMixer`).

The split rule of the head-parallel exchange (:mod:`lightning_cp.parallel.head_parallel`): the heads a rank runs
(value heads, Mamba2's heads, a short convolution's channels) a multiple of ``cp``, and the heads they read
(key heads, B/C groups) a multiple or a divisor of ``cp`` (replicated on the ranks that share one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

from lightning_cp.parallel.head_parallel import head_slices, shared_heads

MixerKind = Literal["gated_deltanet", "kda", "mamba2", "short_conv"]
Device = Literal["cpu", "cuda"]


class MixerShape(Protocol):
    """One token-mixer layer's sizes, their split over CP ranks and their terms in the memory plan."""

    kind: ClassVar[MixerKind]

    def split_problem(self, cp: int) -> str | None:
        """Why the heads (or channels) cannot be split over ``cp`` ranks, with the numbers; ``None`` when they can."""

    def saved_per_token(self, device: Device) -> float:
        """Elements one layer keeps for backward per local token, counted in fp32.

        ``"cpu"``: what ``transformers``' torch kernels save, fitted to measurement within 2% (they cast to fp32
        and keep every chunk's intermediates: hundreds of elements per head). ``"cuda"``: what the fused kernels
        (``fla``, ``mamba-ssm``, ``causal-conv1d``) keep by their design, not measured (no GPU has run them
        here): the convolution's input and output, the scan's inputs and output, the gated norm's gate, and one
        state per chunk of 64 tokens (``dk x dv`` per head).
        """

    def exchanged_per_token(self, cp: int) -> int:
        """Elements the two all-to-alls of one layer's forward send per local token (to the heads and back;
        heads read by several ranks sent to each)."""


def _head_split_problem(heads: int, shared: int, cp: int, heads_name: str, shared_name: str) -> str | None:
    try:
        shared_heads(head_slices(heads, cp, heads_name), heads, shared, shared_name)
    except ValueError as error:
        return str(error)
    return None


@dataclass(frozen=True)
class GatedDeltaNetShape:
    """Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-Hybrid, Lara-mini): ``value_heads`` heads of ``value_dim``
    reading ``key_heads`` key heads of ``key_dim`` (grouped: fewer key than value heads)."""

    kind: ClassVar[MixerKind] = "gated_deltanet"
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int

    def split_problem(self, cp: int) -> str | None:
        return _head_split_problem(self.value_heads, self.key_heads, cp, "value heads", "key heads")

    def saved_per_token(self, device: Device) -> float:
        keys, values, key_dim, value_dim = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        if device == "cpu":
            per_value_head = 11.65 * key_dim + 14.27 * value_dim + 318.4 - 0.47 * key_dim * value_dim / 64
            return 6.2 * keys * key_dim + values * per_value_head
        conv = 2 * keys * key_dim + values * value_dim
        return 2 * conv + values * (3 * value_dim + 2 + key_dim * value_dim / 64)

    def exchanged_per_token(self, cp: int) -> int:
        return 2 * max(self.key_heads, cp) * self.key_dim + self.value_heads * (2 * self.value_dim + 2)


@dataclass(frozen=True)
class KDAShape:
    """Kimi Delta Attention (Kimi-Linear, Bailing-Hybrid): ``heads`` heads of ``dim``, as many key as value heads,
    a decay per channel."""

    kind: ClassVar[MixerKind] = "kda"
    heads: int
    dim: int

    @property
    def key_heads(self) -> int:
        return self.heads

    @property
    def value_heads(self) -> int:
        return self.heads

    @property
    def key_dim(self) -> int:
        return self.dim

    @property
    def value_dim(self) -> int:
        return self.dim

    def split_problem(self, cp: int) -> str | None:
        return _head_split_problem(self.heads, self.heads, cp, "value heads", "key heads")

    def saved_per_token(self, device: Device) -> float:
        if device == "cpu":
            return self.heads * (1509.0 + 224.5 * self.dim)
        return 2 * 3 * self.heads * self.dim + self.heads * (4 * self.dim + 1 + self.dim * self.dim / 64)

    def exchanged_per_token(self, cp: int) -> int:
        return self.heads * (5 * self.dim + 1)


@dataclass(frozen=True)
class Mamba2Shape:
    """Mamba2 (Mamba2, Nemotron-H, Granite-4.0-H, Bamba, Falcon-H1, Zamba2): ``heads`` heads of ``head_dim``, head
    ``h`` reading B/C group ``h // (heads / groups)`` of ``state`` channels each, scanned in chunks of ``chunk``."""

    kind: ClassVar[MixerKind] = "mamba2"
    heads: int
    head_dim: int
    groups: int
    state: int
    chunk: int

    def split_problem(self, cp: int) -> str | None:
        return _head_split_problem(self.heads, self.groups, cp, "heads", "groups")

    def saved_per_token(self, device: Device) -> float:
        heads, dim, groups, state, chunk = self.heads, self.head_dim, self.groups, self.state, self.chunk
        if device == "cpu":
            per_head = 15.18 * dim + 4.51 * state + 3.17 * chunk + 5.5 * dim * state / chunk + 4.5
            return 73.0 + 7.55 * groups * state + heads * per_head
        conv = heads * dim + 2 * groups * state
        return 2 * conv + heads * (3 * dim + 1 + dim * state / chunk)

    def exchanged_per_token(self, cp: int) -> int:
        return self.heads * (2 * self.head_dim + 1) + 2 * max(self.groups, cp) * self.state


@dataclass(frozen=True)
class ShortConvShape:
    """A short convolution (LFM2, LFM2-MoE, LFM3): ``channels`` (the hidden size) convolved one by one, split over
    the ranks in equal blocks."""

    kind: ClassVar[MixerKind] = "short_conv"
    channels: int

    def split_problem(self, cp: int) -> str | None:
        return None if self.channels % cp == 0 else f"hidden_size={self.channels} is not divisible by cp={cp}"

    def saved_per_token(self, device: Device) -> float:
        return 9.0 * self.channels + 8.0 if device == "cpu" else 6.0 * self.channels

    def exchanged_per_token(self, cp: int) -> int:
        return 2 * self.channels
