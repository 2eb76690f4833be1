"""What each ``transformers`` decoder family does under CP: the one table the family matrix holds the code to,
and the support table of ``docs/hf.md`` rendered from it.

``tests/hf/test_families.py`` runs every family (and the real-config variants) at cp = 2 and fails when an
outcome differs from this table; ``test_the_readme_table_is_current`` fails when the table in ``docs/hf.md``
is not :func:`render`'s. After changing an outcome here, refresh ``docs/hf.md`` with::

    python -m tests.hf.support_table
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

HF_DOC = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
"""The document whose support table (between :data:`_BEGIN` and :data:`_END`) is :func:`render`'s."""
# The release whose decoder families this table lists (the ``test`` extra pins it): another release adds or
# drops families, and the matrix's first test says so rather than running a table of another release.
TRANSFORMERS_VERSION = "5.24.0"
_BEGIN, _END = "<!-- hf-support-table: begin -->", "<!-- hf-support-table: end -->"


@dataclass(frozen=True)
class Reason:
    """Why a family is refused: a part of the setup's error message, and the support table's words for it."""

    message: str
    text: str


@dataclass(frozen=True)
class Outcome:
    """``exact`` (the loss and every gradient of the unsharded model), or refused at setup for ``reason``."""

    reason: Reason | None = None

    @property
    def exact(self) -> bool:
        return self.reason is None


@dataclass(frozen=True)
class Variant:
    """A real-config variant of a family: the config fields it sets, and what the table says of them."""

    model_type: str
    fields: dict = field(hash=False)
    option: str
    outcome: Outcome


STATE_SPACE = Reason(
    "is a state-space (Mamba) layer", "state-space (Mamba) layers: their scan sees one shard"
)
LINEAR_ATTENTION = Reason(
    "is linear attention", "linear attention: its recurrent state runs over the sequence"
)
RECURRENT = Reason(
    "is a recurrent layer", "recurrent layers (RG-LRU, xLSTM): their state runs over the sequence"
)
CONVOLUTION = Reason("convolves over the sequence", "short convolutions over the sequence")
TOKEN_SHIFT = Reason("shifts tokens along the sequence", "a token shift (RWKV)")
MIXES = Reason("mixes tokens along the sequence outside", "other token mixing outside attention")
OWN_ATTENTION = Reason(
    "computes attention outside transformers' attention interface",
    "attention computed outside transformers' attention interface",
)
OWN_CLASSES = Reason(
    "computes attention in classes of its own", "attention classes of its own (no attention interface)"
)
READS_MASK = Reason(
    "uses the attention mask itself", "reads the attention mask itself (attention outside the interface)"
)
SPARSE_INDEXER = Reason(
    "is a sparse-attention indexer that lightning_cp's CP indexer does not compute",
    "a sparse-attention indexer over pooled blocks of keys",
)
COMPRESSED = Reason(
    "is DeepSeek-V4's heavily compressed attention",
    "compressed attention: pooled key windows across the shards",
)
BIDIRECTIONAL = Reason("is bidirectional", "bidirectional attention (an encoder)")
POSITION_BIAS = Reason("position_bias=", "an additive position bias")
NO_KEYWORDS = Reason(
    "does not hand the decoder's keyword arguments on", "its layers do not pass cp_shard on to attention"
)
CHUNKED = Reason("chunked attention", "chunked attention (attention_chunk_size)")
LENGTH_ROPE = Reason(
    "recomputes its frequencies", "RoPE frequencies from the sequence length (dynamic, longrope)"
)
OUTPUT = Reason("not what the fused loss computes", "an output transform the fused loss does not apply")
HEAD_PARAMETERS = Reason(
    "are not a plain nn.Linear", "an output head with parameters of its own (a learned logit scale)"
)

EXACT = Outcome()


def refused(reason: Reason) -> Outcome:
    return Outcome(reason)


EXPECTED: dict[str, Outcome] = {
    "afmoe": EXACT,
    "apertus": EXACT,
    "apertus1p5_text": EXACT,
    "arcee": EXACT,
    "aria_text": EXACT,
    "axk1": EXACT,
    "axk2": EXACT,
    "bailing_hybrid": EXACT,
    "bamba": EXACT,
    "beam": EXACT,
    "bert-generation": refused(BIDIRECTIONAL),
    "biogpt": EXACT,
    "bitnet": EXACT,
    "bloom": refused(READS_MASK),
    "codegen": EXACT,
    "cohere": EXACT,
    "cohere2": EXACT,
    "cohere2_moe": EXACT,
    "cohere_compass_text": EXACT,
    "cpmant": refused(MIXES),
    "ctrl": EXACT,
    "cwm": EXACT,
    "dbrx": EXACT,
    "deepseek_v2": EXACT,
    "deepseek_v3": EXACT,
    "deepseek_v32": EXACT,
    "deepseek_v4": refused(COMPRESSED),
    "diffllama": EXACT,
    "doge": refused(READS_MASK),
    "dory": refused(HEAD_PARAMETERS),
    "dots1": EXACT,
    "dots3_note_text": EXACT,
    "ernie4_5": EXACT,
    "ernie4_5_moe": EXACT,
    "exaone": EXACT,
    "exaone4": EXACT,
    "exaone_moe": EXACT,
    "falcon": refused(OWN_CLASSES),
    "falcon_h1": EXACT,
    "falcon_mamba": refused(STATE_SPACE),
    "flex_olmo": EXACT,
    "flint": EXACT,
    "gemma": EXACT,
    "gemma2": EXACT,
    "gemma3_text": EXACT,
    "gemma3n_text": EXACT,
    "gemma4_text": EXACT,
    "gemma4_unified_text": EXACT,
    "glm": EXACT,
    "glm4": EXACT,
    "glm4_moe": EXACT,
    "glm4_moe_lite": EXACT,
    "glm_moe_dsa": EXACT,
    "gpt2": EXACT,
    "gpt_bigcode": EXACT,
    "gpt_neo": refused(OWN_CLASSES),
    "gpt_neox": EXACT,
    "gpt_neox_japanese": refused(READS_MASK),
    "gpt_oss": EXACT,
    "gptj": EXACT,
    "granite": EXACT,
    "granite_swa": EXACT,
    "granitemoe": EXACT,
    "granitemoe_swa": EXACT,
    "granitemoehybrid": EXACT,
    "granitemoeshared": EXACT,
    "helium": EXACT,
    "hrm_text": EXACT,
    "hunyuan_v1_dense": EXACT,
    "hunyuan_v1_moe": EXACT,
    "hy_v3": EXACT,
    "hy_v4": EXACT,
    "hyperclovax": EXACT,
    "inkling2_loop_text": refused(POSITION_BIAS),
    "inkling2_text": refused(POSITION_BIAS),
    "inkling_text": refused(OUTPUT),
    "internlm3": EXACT,
    "iquestcoder": EXACT,
    "jais2": EXACT,
    "jamba": refused(STATE_SPACE),
    "jetmoe": EXACT,
    "kimi_linear": EXACT,
    "kolibri1": EXACT,
    "laguna": EXACT,
    "lara_mini": EXACT,
    "lfm2": EXACT,
    "lfm2_moe": EXACT,
    "lfm3": EXACT,
    "llama": EXACT,
    "llama4_text": refused(CHUNKED),
    "longcat_flash": EXACT,
    "mamba": refused(STATE_SPACE),
    "mamba2": EXACT,
    "mellum": EXACT,
    "mimo_v2_flash": EXACT,
    "minicpm3": EXACT,
    "minimax": refused(LINEAR_ATTENTION),
    "minimax_m2": EXACT,
    "minimax_m3_vl_text": EXACT,
    "ministral": EXACT,
    "ministral3": EXACT,
    "mistral": EXACT,
    "mixtral": EXACT,
    "modernbert-decoder": refused(OUTPUT),
    "mpt": refused(READS_MASK),
    "nanochat": EXACT,
    "nemotron": refused(NO_KEYWORDS),
    "nemotron_h": EXACT,
    "olmo": EXACT,
    "olmo2": EXACT,
    "olmo3": EXACT,
    "olmo_hybrid": EXACT,
    "olmoe": EXACT,
    "openai-gpt": refused(OWN_ATTENTION),
    "opt": EXACT,
    "persimmon": EXACT,
    "phi": EXACT,
    "phi3": EXACT,
    "phimoe": EXACT,
    "qwen2": EXACT,
    "qwen2_moe": EXACT,
    "qwen3": EXACT,
    "qwen3_5_moe_text": EXACT,
    "qwen3_5_text": EXACT,
    "qwen3_moe": EXACT,
    "qwen3_next": EXACT,
    "qwen4_exp_text": refused(SPARSE_INDEXER),
    "recurrent_gemma": refused(RECURRENT),
    "rwkv": refused(TOKEN_SHIFT),
    "sarvam_mla": EXACT,
    "sarvam_moe": EXACT,
    "seed_oss": EXACT,
    "smollm3": EXACT,
    "solar_open": EXACT,
    "stablelm": refused(NO_KEYWORDS),
    "starcoder2": EXACT,
    "trocr": refused(READS_MASK),
    "vaultgemma": EXACT,
    "xglm": refused(READS_MASK),
    "xlnet": refused(MIXES),
    "xlstm": refused(RECURRENT),
    "youtu": EXACT,
    "zamba": refused(STATE_SPACE),
    "zamba2": EXACT,
    "zaya": refused(MIXES),
}

VARIANTS: dict[str, Variant] = {
    "gemma3 windows": Variant(
        "gemma3_text",
        {
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "num_hidden_layers": 3,
            "sliding_window": 5,
            "query_pre_attn_scalar": 16,
        },
        "with alternating 5-token sliding windows and `query_pre_attn_scalar` (Gemma-3)",
        EXACT,
    ),
    "gemma2 softcaps": Variant(
        "gemma2",
        {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, "sliding_window": 5},
        "with attention and final logit softcapping that bind (2.0, 3.0)",
        EXACT,
    ),
    "granite-3 multipliers": Variant(
        "granite",
        {
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.015625,
            "logits_scaling": 8.0,
        },
        "with Granite-3's multipliers and `logits_scaling=8`",
        EXACT,
    ),
    "cohere logit scale": Variant(
        "cohere", {"logit_scale": 0.125, "use_qk_norm": True}, "with `logit_scale=0.125` and QK norms", EXACT
    ),
    "qwen2 sliding layers": Variant(
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
        "with a 5-token sliding window above layer 1",
        EXACT,
    ),
    "mixtral router loss": Variant(
        "mixtral",
        {"output_router_logits": True, "router_aux_loss_coef": 0.1},
        "with `output_router_logits` (its load-balancing loss reduced over DP x CP)",
        EXACT,
    ),
    "llama dynamic rope": Variant(
        "llama",
        {
            "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4},
            "max_position_embeddings": 16,
        },
        "with dynamic RoPE scaling",
        refused(LENGTH_ROPE),
    ),
    "phi3 longrope": Variant(
        "phi3",
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "short_factor": [1.0] * 4,
                "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 16,
            },
        },
        "with `longrope` (Phi-3.5's RoPE)",
        refused(LENGTH_ROPE),
    ),
}


def render() -> str:
    """The support table of ``docs/hf.md``: outcomes, the families of each, then variants and exclusions."""
    from tests.hf._families import families

    _, excluded = families()
    groups: dict[str, list[str]] = {}
    for name, outcome in EXPECTED.items():
        groups.setdefault("exact" if outcome.exact else f"refused: {outcome.reason.text}", []).append(name)
    rows = [
        f"| {outcome} | {len(names)} | {', '.join(sorted(names))} |" for outcome, names in _ordered(groups)
    ]
    variants = [
        f"| `{v.model_type}` {v.option} | {'exact' if v.outcome.exact else f'refused: {v.outcome.reason.text}'} |"
        for v in VARIANTS.values()
    ]
    exclusions: dict[str, list[str]] = {}
    for name, why in excluded.items():
        exclusions.setdefault(re.sub(r" \(.*\)|: .*| of .*", "", why), []).append(name)
    lines = [
        _BEGIN,
        "",
        "| outcome at cp = 2 | families | model types |",
        "|---|---:|---|",
        *rows,
        "",
        "| real-config variant | outcome |",
        "|---|---|",
        *variants,
        "",
        "Not in the matrix (not decoder-only text models): "
        + "; ".join(f"{why}: {', '.join(names)}" for why, names in exclusions.items())
        + ".",
        "",
        _END,
    ]
    return "\n".join(lines)


def _ordered(groups: dict[str, list[str]]) -> list[tuple[str, list[str]]]:
    return sorted(groups.items(), key=lambda item: (item[0] != "exact", -len(item[1]), item[0]))


def documented_table() -> str:
    """The table between the markers of ``docs/hf.md`` (markers included), or ``""`` if it has none."""
    text = HF_DOC.read_text()
    start, end = text.find(_BEGIN), text.find(_END)
    return text[start : end + len(_END)] if 0 <= start < end else ""


def write_table() -> None:
    """Replace the table of ``docs/hf.md`` (between its markers) with :func:`render`'s."""
    text, table = HF_DOC.read_text(), documented_table()
    if not table:
        sys.exit(f"{HF_DOC} has no {_BEGIN} ... {_END} section to fill.")
    HF_DOC.write_text(text.replace(table, render()))


if __name__ == "__main__":
    write_table()
