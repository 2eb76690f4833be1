"""The plan's headline figures that README.md and docs/plan.md state, recomputed from the code.

A change to a term of the plan that moves a stated longest sequence (with the model state on the host and
on the GPUs), its host memory or host-device copies, or the best peak of Llama-3-8B at 1M tokens, fails
here until the documents (and the one-GPU config's length) are regenerated.
"""

from __future__ import annotations

import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest
import yaml

from lightning_cp.cli.plan import main, read_model
from lightning_cp.plan import Candidate, layouts, max_seq_len
from lightning_cp.plan.lora import LoRA
from lightning_cp.plan.search import candidate
from lightning_cp.plan.shape import ModelShape

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "examples" / "configs" / "models"
README = (ROOT / "README.md").read_text()
PLAN_DOC = (ROOT / "docs" / "plan.md").read_text()
GiB = 2**30
GB80 = 80 * 10**9


@functools.cache
def _plan(model: str, *argv: str) -> str:
    """``lightning-cp plan`` on 80 GB GPUs unless ``argv`` says otherwise; its output, once per arguments."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([str(MODELS / model), "--gpu-memory", "80GB", *argv]) == 0
    return out.getvalue()


def _flat(text: str) -> str:
    """The text with its line breaks and emphasis removed, as a sentence reads."""
    return re.sub(r"\s+", " ", text.replace("**", ""))


STATED = _flat(PLAN_DOC) + " " + _flat(README)


def _rows(out: str) -> list[dict[str, str]]:
    """The layouts of a plan's output that fit: name, the GiB columns and the largest transient's name."""
    columns = ("params", "grads", "optim", "fsdp", "saved", "transient", "largest", "reserve", "peak")
    columns += ("host", "h2d", "cp", "dp", "pflop")
    rows = []
    for line in out.splitlines():
        if line.startswith("dp") and not line.endswith("does not fit"):
            words = line.split()
            rows.append(
                {"name": " ".join(words[: -len(columns)])} | dict(zip(columns, words[-len(columns) :]))
            )
    return rows


def _longest(out: str) -> int:
    return int(re.search(r"longest sequence on .*: ([\d,]+) tokens", out)[1].replace(",", ""))


@functools.cache
def _longest_on_gpus(model: str, gpus: int, gpu_bytes: int = GB80) -> tuple[int, Candidate | None]:
    """The longest sequence of the layouts that keep the model state on the GPUs, and its candidate."""
    shape = read_model(str(MODELS / model))
    found = [
        (max_seq_len(shape, layout, gpu_bytes), layout)
        for layout in layouts(gpus, shape)
        if not layout.cpu_offload
    ]
    tokens, layout = max(found, key=lambda pair: pair[0])
    return tokens, candidate(shape, tokens, layout) if tokens else None


@pytest.mark.parametrize(
    ("model", "gpus", "memory", "target", "readme"),
    [
        ("llama3_8b.json", 1, "80GB", ("1M", 2**20), "| Llama-3.1-8B | 1 | {n} | {host} |"),
        ("llama3_8b.json", 1, "141GB", ("1.5M", 1_500_000), "| Llama-3.1-8B | 1 of 141 GB | {n} | {host} |"),
        ("qwen3_30b_a3b.json", 8, "80GB", ("1M fits, 2M", 2**21), "| Qwen3-30B-A3B | 8 | {n} | {host} |"),
        ("qwen3_5_35b_a3b.json", 8, "80GB", ("1M", 2**20), "| Qwen3.5-35B-A3B | 8 | {n} | {host} |"),
        ("qwen3_5_35b_a3b.json", 2, "80GB", ("128K", 2**17), "| Qwen3.5-35B-A3B | 2 | {n} | {host} |"),
        (
            "llama3_8b.json",
            8,
            "80GB",
            ("not worse than 5.55M", 5_549_056),
            "| Llama-3-8B | 8 | {n} | {host} |",
        ),
    ],
    ids=[
        "llama3-8b-1x80",
        "llama3-8b-1x141",
        "qwen3-30b-a3b-8",
        "qwen3.5-35b-a3b-8",
        "qwen3.5-35b-a3b-2",
        "llama3-8b-8",
    ],
)
def test_the_gpus_users_own_table_is_the_plan_s(
    model: str, gpus: int, memory: str, target: tuple[str, int], readme: str
) -> None:
    """docs/plan.md's "The GPUs users own" row (the longest sequence on the GPUs and on the host, its layout,
    host memory, host-device copies and whether the target is met) and README's row, from the plan."""
    out = _plan(model, "--gpus", str(gpus), "--gpu-memory", memory, "--max-seq")
    longest, row = _longest(out), _rows(out)[0]
    on_gpus, _ = _longest_on_gpus(model, gpus, int(memory.removesuffix("GB")) * 10**9)
    # The Llama-3-8B target is that the state on the GPUs does not lose the 5.55M it had.
    reached = on_gpus if target[0].startswith("not worse") else longest
    verdict = f"{target[0]}: {'met' if reached >= target[1] else 'not met'}"
    on_gpus_text = f"{on_gpus:,}" if on_gpus else "not even 1,024 tokens"
    phrase = f"| {on_gpus_text} | {longest:,} | {row['name']} | {row['host']} | {row['h2d']} | {verdict} |"
    assert phrase in _flat(PLAN_DOC), phrase
    readme_row = readme.format(n=f"{longest:,}", host=f"{float(row['host']):.0f}")
    assert readme_row in _flat(README), readme_row


@pytest.mark.parametrize(
    ("model", "gpus", "phrases"),
    [
        (
            "llama3_8b.json",
            8,
            [
                "Llama-3-8B {host} tokens on 8 H100 with the model state on the host",
                "and {gpu} with it on the GPUs ({gpu_host} GiB",
                "at most {gpu} tokens with the state on the GPUs",
                "{host} with it on the host.",
            ],
        ),
        (
            "llama3_70b.json",
            64,
            [
                "Llama-3-70B {host} on 64 H100 with the model state on the host",
                "and {gpu} with it on the GPUs.",
                "at most {host} tokens with the state on the host",
                "and {gpu} with it on the GPUs (per GPU",
            ],
        ),
    ],
    ids=["llama3-8b", "llama3-70b"],
)
def test_the_longest_sequences_stated_are_the_plan_s(model: str, gpus: int, phrases: list[str]) -> None:
    host = _longest(_plan(model, "--gpus", str(gpus), "--max-seq"))
    gpu, on_gpus = _longest_on_gpus(model, gpus)
    gpu_host = f"{on_gpus.estimate.host / GiB:.0f}"  # the offloaded layer inputs' host memory per GPU
    for phrase in phrases:
        stated = phrase.format(host=f"{host / 1e6:.2f}M", gpu=f"{gpu / 1e6:.2f}M", gpu_host=gpu_host)
        assert stated in STATED, stated


def test_the_70b_terms_stated_are_the_plan_s() -> None:
    _, on_gpus = _longest_on_gpus("llama3_70b.json", 64)
    e = on_gpus.estimate
    terms = (
        f"parameters {e.parameters / GiB:.1f} GiB, gradients {e.gradients / GiB:.1f}, AdamW "
        f"{e.optimizer / GiB:.1f}, FSDP's gathered root and units {e.fsdp_gathered / GiB:.1f}, saved "
        f"{e.activations / GiB:.1f}, one checkpointed layer's recomputation {e.transient / GiB:.1f}"
    )
    assert terms in _flat(README), terms
    row = _rows(_plan("llama3_70b.json", "--gpus", "64", "--max-seq"))[0]
    assert "+cpu_offload" in row["name"] and row["largest"] == "recompute", row
    terms = (
        f"FSDP's gathered root and units {row['fsdp']}, saved {row['saved']}, the recomputation of one layer "
        f"{row['transient']}, reserve {row['reserve']}: {row['peak']} GiB; "
        f"{float(row['host']):.0f} GiB of host"
    )
    assert terms in _flat(PLAN_DOC), terms


def test_the_best_peak_of_llama_3_8b_at_1m_on_8_gpus_is_the_plan_s() -> None:
    out = _plan("llama3_8b.json", "--gpus", "8", "--seq-len", "1M")
    rows = _rows(out)
    on_gpus = min((r for r in rows if "+cpu_offload" not in r["name"]), key=lambda r: float(r["peak"]))
    on_host = min((r for r in rows if "+cpu_offload" in r["name"]), key=lambda r: float(r["peak"]))
    assert on_host["name"] == on_gpus["name"] + " +cpu_offload", (on_gpus, on_host)
    fit = re.search(r"(\d+ of \d+) layouts fit", out)[1]
    readme = (
        f"fits 8 H100s in {fit} layouts (the best at {on_gpus['peak']} GiB per GPU with the model state on "
        f"the GPUs, {on_host['peak']} with it on the host"
    )
    assert readme in _flat(README), readme
    on_gpus_phrase = (
        f"plans to {on_gpus['peak']} GiB per GPU at best with the model state on the GPUs "
        f"(`{on_gpus['name']}`"
    )
    on_host_phrase = (
        f"and to {on_host['peak']} GiB with it on the host ({float(on_host['host']):.0f} GiB of host "
        f"memory per GPU, {float(on_host['h2d']):.0f} GiB copied per step)"
    )
    for phrase in (on_gpus_phrase, on_host_phrase):
        assert phrase in _flat(PLAN_DOC), phrase


def test_what_bounds_llama_3_1_8b_on_one_gpu_is_the_plan_s() -> None:
    """Llama-3.1-8B on one 80 GB GPU: 1M does not fit (its smallest peak stated); the longest that does is the
    one-GPU config's length. There: how many layouts fit, the first, its peak and its terms, the largest
    transient (the recomputation of one checkpointed layer) and what that holds: the layer's saved tensors
    and the previous layer's input, which the offload brings back ahead of need, beside its tiled MLP's
    transient."""
    at_1m = _plan("llama3_8b.json", "--gpus", "1", "--seq-len", "1M")
    smallest = re.search(r"no layout fits [\d.]+ GiB; the smallest peak is ([\d.]+) GiB", at_1m)[1]
    longest = _longest(_plan("llama3_8b.json", "--gpus", "1", "--max-seq"))
    config = yaml.safe_load((ROOT / "examples" / "configs" / "hf_llama_1gpu.yaml").read_text())
    assert config["data"]["init_args"]["seq_len"] == longest
    out = _plan("llama3_8b.json", "--gpus", "1", "--seq-len", str(longest), "--all")
    fit = re.search(r"(\d+ of \d+) layouts fit", out)[1]
    row = _rows(out)[0]
    assert row["largest"] == "recompute", row
    shape = read_model(str(MODELS / "llama3_8b.json"))
    layout = next(layout for layout in layouts(1, shape) if layout.name() == row["name"])
    e = candidate(shape, longest, layout).estimate
    assert e.mlp >= e.counted_transient("attention"), e  # the MLP's transient, not the attention's
    prefetched = longest * shape.hidden * 2  # the previous layer's bf16 input, the whole sequence at cp 1
    phrase = (
        f"reaches {longest:,} tokens, not 1M: at 1M (`--seq-len 1M --gpus 1 --all`) no layout fits, the "
        f"smallest peak {smallest} GiB. At {longest:,} (`--seq-len {longest} --gpus 1 --all`) {fit} layouts "
        f"fit: `{row['name']}`, at {row['peak']} GiB: FSDP's gathered units {row['fsdp']}, saved {row['saved']} "
        f"(the final norm's bf16 input), reserve {row['reserve']}, and the largest transient, the "
        f"recomputation of one checkpointed layer, {row['transient']} GiB: the layer's saved tensors rebuilt in "
        f"its backward, {(e.recompute - prefetched - e.mlp) / GiB:.1f} GiB at {longest:,} local tokens (the two "
        "norms' bf16 inputs, q, k, v and the attention output), and the previous layer's input, which the "
        "offload brings back from the host while this layer recomputes and back-propagates, "
        f"{prefetched / GiB:.1f}, beside its tiled MLP's transient, {e.mlp / GiB:.1f}"
    )
    assert phrase in _flat(PLAN_DOC), phrase
    readme = f"Llama-3.1-8B fits {longest:,} tokens on one 80 GB GPU ({row['peak']} GiB planned"
    assert readme in _flat(README) and f"at 1M it plans {smallest})" in _flat(README), readme
    # The same layout under Lightning's default precision, which the printed arguments set otherwise.
    fp32 = candidate(shape, longest, layout, precision="32-true").estimate.peak / GiB
    phrase = f"Llama-3-8B's one-GPU layout at {longest:,} tokens then needs {fp32:.1f} GiB, not {row['peak']}"
    assert phrase in _flat(PLAN_DOC), phrase


def test_the_host_memory_example_is_the_plan_s() -> None:
    out = _plan("llama3_8b.json", "--gpus", "1", "--max-seq", "--host-memory", "240GB")
    row = _rows(out)[0]
    phrase = (
        f"plans {_longest(out):,} tokens (`{row['name']}`, {row['host']} GiB of host memory, "
        f"{row['h2d']} GiB "
        "copied per step)"
    )
    assert phrase in _flat(PLAN_DOC), phrase


@pytest.mark.parametrize(
    ("model", "gpus", "seq_len", "phrase"),
    [
        (
            "qwen3_30b_a3b.json",
            8,
            "1M",
            "Qwen3-30B-A3B at 1M tokens on 8 GPUs fits {fit} layouts, every one with the model state",
        ),
        (
            "qwen3_5_35b_a3b.json",
            8,
            "1M",
            "1M tokens fit {fit} layouts (the smallest peak {peak} GiB, `{name}`",
        ),
        (
            "qwen3_5_35b_a3b.json",
            2,
            "128K",
            "128K on 2 GPUs fit {fit} (the smallest peak {peak} GiB, `{name}`",
        ),
    ],
    ids=["qwen3-30b-a3b-1m-8", "qwen3.5-35b-a3b-1m-8", "qwen3.5-35b-a3b-128k-2"],
)
def test_the_moe_models_at_their_targets_are_the_plan_s(
    model: str, gpus: int, seq_len: str, phrase: str
) -> None:
    out = _plan(model, "--gpus", str(gpus), "--seq-len", seq_len)
    rows = _rows(out)
    assert all("+cpu_offload" in row["name"] for row in rows), rows
    smallest = min(rows, key=lambda row: float(row["peak"]))
    fit = re.search(r"(\d+ of \d+) layouts fit", out)[1]
    stated = phrase.format(fit=fit, peak=smallest["peak"], name=smallest["name"])
    assert stated in _flat(PLAN_DOC), stated


def test_the_cheapest_qwen3_30b_a3b_layout_at_1m_on_8_gpus_is_the_plan_s() -> None:
    first = _rows(_plan("qwen3_30b_a3b.json", "--gpus", "8", "--seq-len", "1M"))[0]
    stated = (
        f"`{first['name']}`, plans {first['peak']} GiB per GPU ({float(first['host']):.0f} GiB of host "
        "memory, "
        f"{float(first['h2d']):.0f} GiB copied per step"
    )
    assert stated in _flat(PLAN_DOC), stated


def test_the_sample_output_is_the_plan_s() -> None:
    """docs/plan.md's sample output is the command's, line for line."""
    sample = re.search(r"```\n(transformers: 8\.03B.*?)```", PLAN_DOC, re.DOTALL)[1]
    assert sample.strip() == _plan("llama3_8b.json", "--seq-len", "1M", "--gpus", "8").strip()


def test_the_2tb_node_example_is_the_plan_s() -> None:
    """An 8-GPU node of 2 TB (``--host-memory 250GB``): Llama-3-8B and Qwen3-30B-A3B shorter than without the
    check (at their longest they keep more than 250 GB per GPU on the host), Qwen3.5-35B-A3B not (its longest
    keeps less)."""
    models = ("llama3_8b.json", "qwen3_30b_a3b.json", "qwen3_5_35b_a3b.json")
    checked = [_plan(m, "--gpus", "8", "--max-seq", "--host-memory", "250GB") for m in models]
    free = [_plan(m, "--gpus", "8", "--max-seq") for m in models]
    limit = 250 * 10**9 / GiB
    hosts = [float(_rows(out)[0]["host"]) for out in free]
    for out, free_out, host in zip(checked, free, hosts, strict=True):
        assert (_longest(out) < _longest(free_out)) == (host > limit), (host, limit)
    assert hosts[0] > limit and hosts[1] > limit and hosts[2] <= limit
    (llama, qwen, qwen35), (llama_free, qwen_free, qwen35_free) = (
        [f"{_longest(out):,}" for out in outs] for outs in (checked, free)
    )
    stated = (
        f"`--host-memory 250GB` plans {llama} tokens at {float(_rows(checked[0])[0]['host']):.0f} GiB",
        (
            f"Llama-3-8B {llama} tokens, Qwen3-30B-A3B {qwen} and Qwen3.5-35B-A3B {qwen35} ({llama_free}, "
            f"{qwen_free} and {qwen35_free} without the check"
        ),
        (
            f"at their longest Llama-3-8B keeps {hosts[0]:.1f} GiB per GPU on the host and Qwen3-30B-A3B "
            f"{hosts[1]:.1f}, more than 250 GB, {limit:.1f} GiB; Qwen3.5-35B-A3B {hosts[2]:.1f}, within it"
        ),
    )
    for phrase in stated:
        assert phrase in _flat(PLAN_DOC), phrase


_LORA_ROWS = [
    ("llama3_8b.json", "--gpus 1 --lora 16 --host-memory 256GB", ("684K", 684_000)),
    ("llama3_70b.json", "--gpus 1 --qlora --host-memory 256GB", ("178K", 178_000)),
    ("llama3_8b.json", "--gpus 1 --qlora --gpu-memory 24GB --host-memory 64GB", ("128K", 2**17)),
    ("qwen3_5_35b_a3b.json", "--gpus 1 --qlora", None),
    ("qwen3_5_35b_a3b.json", "--gpus 8 --lora 16", None),
]


@pytest.mark.parametrize(("model", "argv", "target"), _LORA_ROWS, ids=[f"{m}-{a}" for m, a, _ in _LORA_ROWS])
def test_the_lora_targets_table_is_the_plan_s(model: str, argv: str, target: tuple[str, int] | None) -> None:
    """docs/plan.md's LoRA / QLoRA table: the longest sequence, its layout, peak and host memory, and whether
    the target is met."""
    out = _plan(model, *argv.split(), "--max-seq")
    longest, row = _longest(out), _rows(out)[0]
    verdict = "" if target is None else f"{target[0]}: {'met' if longest >= target[1] else 'not met'}"
    phrase = (
        f"| `{argv}` | {longest:,} | {row['name']} | {row['peak']} | {row['host']} | {verdict} |".replace(
            "|  |", "| |"
        )
    )
    assert phrase in _flat(PLAN_DOC), phrase


def _at_longest_and_past(
    model: str, argv: str, lora: LoRA, host_bytes: int
) -> tuple[int, Candidate, Candidate]:
    """A LoRA row's longest sequence, its candidate there and at 1,024 tokens more (the same layout before
    the host split, the same host memory)."""
    out = _plan(model, *argv.split(), "--max-seq")
    longest, row = _longest(out), _rows(out)[0]
    shape = read_model(str(MODELS / model))
    name = re.sub(r"\+offload:\d+", "+offload", row["name"])
    layout = next(layout for layout in layouts(1, shape) if layout.name() == name)
    at, past = (
        candidate(shape, n, layout, lora=lora, host_bytes=host_bytes) for n in (longest, longest + 1024)
    )
    assert at.layout.name() == row["name"], (at.layout, row)
    return longest, at, past


def _host_split(found: Candidate, layers: int) -> tuple[int, int]:
    """(layers whose inputs are on the host, layers whose inputs are on the GPU)."""
    on_host = found.layout.offloaded_layers(layers)
    return on_host, layers - on_host


def _beside_the_inputs(found: Candidate, shape: ModelShape, tokens: int) -> float:
    """GiB the host holds besides the offloaded layer inputs (one GPU: each input is ``tokens x hidden``
    bf16, in its pinned pages)."""
    from lightning_cp.plan.terms import pinned_bytes

    inputs = _host_split(found, shape.layers)[0] * pinned_bytes(tokens * shape.hidden * 2, "cuda")
    return (found.estimate.host - inputs) / GiB


def test_what_binds_the_lora_targets_is_the_plan_s(monkeypatch) -> None:
    """The LoRA section's figures: the bases' sizes; for each target its layer input, how many layers' inputs
    the host holds beside the base (not one more), and at 1,024 tokens more what the GPU cannot hold: one
    input more (the 70B, the 24 GB GPU) or the same one (the 8B); the longest without the host check; with
    the layer inputs' host copies of their exact size; and with the whole-block power-of-two rounding the
    offload's pages replaced, which missed two targets."""
    from lightning_cp.plan import terms

    llama, llama70 = (read_model(str(MODELS / m)) for m in ("llama3_8b.json", "llama3_70b.json"))
    host256, host64 = 256 * 10**9, 64 * 10**9
    eight = _at_longest_and_past(
        "llama3_8b.json", "--gpus 1 --lora 16 --host-memory 256GB", LoRA(16), host256
    )
    seventy = _at_longest_and_past(
        "llama3_70b.json", "--gpus 1 --qlora --host-memory 256GB", LoRA(16, "nf4"), host256
    )
    small = _at_longest_and_past(
        "llama3_8b.json", "--gpus 1 --qlora --gpu-memory 24GB --host-memory 64GB", LoRA(16, "nf4"), host64
    )
    for (longest, at, past), shape, gpu_bytes, host_bytes in (
        (eight, llama, GB80, host256),
        (seventy, llama70, GB80, host256),
        (small, llama, 24 * 10**9, host64),
    ):  # the host is full (one more layer's input would not fit), and 1,024 tokens more the GPU cannot hold
        one_more = terms.pinned_bytes(longest * shape.hidden * 2, "cuda")
        assert at.estimate.host <= host_bytes < at.estimate.host + one_more
        assert at.estimate.peak <= gpu_bytes < past.estimate.peak
        assert _host_split(past, shape.layers)[0] <= _host_split(at, shape.layers)[0]
    free = {
        m: _plan(m, "--gpus", "1", a, "--max-seq")
        for m, a in (("llama3_8b.json", "--lora=16"), ("llama3_70b.json", "--qlora"))
    }

    longest, at, past = eight
    kept, on_gpu = _host_split(at, 32)
    assert on_gpu == 1 and _host_split(past, 32) == (kept, on_gpu)
    phrases = [
        f"Llama-3.1-8B: {LoRA(16).base_bytes(llama, 2) / GiB:.1f} GiB, not the 119.7",
        f"{LoRA(16).adapters(llama) / 1e6:.1f}M for Llama-3.1-8B",
        (
            f"Llama-3.1-8B's base {LoRA(16, 'nf4').base_bytes(llama, 2) / GiB:.1f} GiB, Llama-3.3-70B's "
            f"{LoRA(16, 'nf4').base_bytes(llama70, 2) / GiB:.1f}"
        ),
        f"(Llama-3.3-70B's MLP: {LoRA(16, 'nf4').dequantized_bytes(llama70) / GiB:.1f} GiB)",
        (
            f"Llama-3.1-8B's layer input at {longest:,} tokens is {longest * 4096 * 2 / GiB:.2f} GiB: {kept} of 32 "
            "fit on the host beside the base and the adapters' state (together "
            f"{_beside_the_inputs(at, llama, longest):.1f} GiB), {at.estimate.host / GiB:.1f} of the "
            f"{host256 / GiB:.1f} GiB that 256 GB is, and the 32nd would not; the other stays on the GPU, at a "
            f"peak of {at.estimate.peak / GiB:.1f} GiB; at 1,024 tokens more the host still holds {kept}, and the "
            f"GPU's peak passes its {GB80 / GiB:.1f} GiB by {(past.estimate.peak - GB80) / 2**20:.0f} MiB."
        ),
        f"it plans {_longest(free['llama3_8b.json']):,} tokens ({_rows(free['llama3_8b.json'])[0]['host']} GiB",
    ]
    longest, at, past = seventy
    kept, on_gpu = _host_split(at, 80)
    phrases += [
        (
            f"Llama-3.3-70B's layer input at {longest:,} tokens is {longest * 8192 * 2 / GiB:.2f} GiB: {kept} of "
            f"80 fit on the host beside the NF4 base and the adapters' state (together "
            f"{_beside_the_inputs(at, llama70, longest):.1f} GiB), the other {on_gpu} stay on the GPU beside the recomputation of one "
            f"layer, {at.estimate.transient / GiB:.1f} GiB: {at.estimate.peak / GiB:.1f} GiB; at 1,024 tokens "
            f"more the host holds {kept - 1} and the GPU's {on_gpu + 1} take it to "
            f"{past.estimate.peak / GiB:.1f} GiB"
        ),
        (
            f"(without the host check: {_longest(free['llama3_70b.json']):,} tokens, "
            f"{_rows(free['llama3_70b.json'])[0]['host']} GiB)"
        ),
    ]
    longest, at, past = small
    kept, on_gpu = _host_split(at, 32)
    assert on_gpu == 1
    phrases.append(
        f"reaches {longest:,} tokens, {kept} of 32 layers' inputs on the host ({at.estimate.host / GiB:.1f} GiB), "
        f"the other on the GPU: {at.estimate.peak / GiB:.1f} GiB; at 1,024 tokens more, {kept - 1} and "
        f"{past.estimate.peak / GiB:.1f}."
    )

    def longest_with(rule, *rows) -> list[int]:
        """The longest of every one-GPU layout with ``pinned_bytes`` replaced by ``rule``."""
        monkeypatch.setattr(terms, "pinned_bytes", rule)
        found = [
            max(max_seq_len(shape, layout, gpu, host_bytes=host, lora=lora) for layout in layouts(1, shape))
            for shape, lora, gpu, host in rows
        ]
        monkeypatch.undo()
        return found

    targets = ((llama, LoRA(16), GB80, host256), (llama70, LoRA(16, "nf4"), GB80, host256))
    exact = longest_with(lambda nbytes, device: nbytes, *targets)
    costs = [
        f"{e - n:,} tokens" if e > n else "none" for e, n in zip(exact, (eight[0], seventy[0]), strict=True)
    ]
    phrases.append(
        f"the plan gives {exact[0]:,} and {exact[1]:,} tokens: the last page's rounding costs the 8B "
        f"{costs[0]} and the 70B {costs[1]}."
    )
    whole_block = longest_with(
        lambda nbytes, device: nbytes if device != "cuda" or nbytes == 0 else 1 << (nbytes - 1).bit_length(),
        *targets,
        (llama, LoRA(16, "nf4"), 24 * 10**9, host64),
    )
    assert whole_block[0] < 684_000 and whole_block[1] < 178_000
    phrases.append(f"the first two targets were not met: {whole_block[0]:,} and {whole_block[1]:,} tokens")
    phrases.append(f"and {whole_block[2]:,} on the 24 GB GPU.")
    assert eight[0] >= 684_000 and seventy[0] >= 178_000 and small[0] >= 2**17
    for phrase in phrases:
        assert phrase in _flat(PLAN_DOC), phrase


MLA_LAYOUT = "dp1 x cp8 FSDP kv1/gather +ckpt +offload +tiled"


@pytest.mark.parametrize(
    ("model", "seq_len", "row"),
    [
        ("glm4_7_flash.json", "131,072", "| GLM-4.7-Flash | 131,072 | 514.1 | **{cp}** | 70.0 | {peak} |"),
        (
            "glm4_7_flash.json",
            "1,048,576",
            "| GLM-4.7-Flash | 1,048,576 | 4,112.5 | **{cp}** | 82.5 | {peak} |",
        ),
        (
            "deepseek_v2_lite.json",
            "131,072",
            "| DeepSeek-V2-Lite | 131,072 | 147.7 | **{cp}** | 40.5 | {peak} |",
        ),
        (
            "deepseek_v2_lite.json",
            "1,048,576",
            "| DeepSeek-V2-Lite | 1,048,576 | 1,181.2 (Ulysses: 212.6) | **{cp}** | 47.5 | {peak} |",
        ),
    ],
    ids=["glm-4.7-flash-128k", "glm-4.7-flash-1m", "deepseek-v2-lite-128k", "deepseek-v2-lite-1m"],
)
def test_the_mla_models_latent_exchange_figures_are_the_plan_s(model: str, seq_len: str, row: str) -> None:
    pytest.importorskip("transformers")
    out = _plan(model, "--gpus", "8", "--seq-len", seq_len.replace(",", ""), "--all")
    found = next(line.split() for line in out.splitlines() if line.startswith(MLA_LAYOUT + " "))
    columns = found[len(MLA_LAYOUT.split()) :]
    # params grads optim fsdp saved transient largest reserve peak host h2d cp dp pflop
    assert row.format(cp=columns[11], peak=columns[8]) in PLAN_DOC


@pytest.mark.parametrize(
    ("model", "longest"), [("glm4_7_flash.json", "4,967,424"), ("deepseek_v2_lite.json", "6,940,672")]
)
def test_the_mla_models_longest_sequences_are_the_plan_s(model: str, longest: str) -> None:
    pytest.importorskip("transformers")
    assert f"{_longest(_plan(model, '--gpus', '8', '--max-seq')):,}" == longest
    assert f"**{longest}**" in PLAN_DOC


_SHOWN = re.compile(r"```bash\n(lightning-cp plan[^\n]*)\n```\s*\n```\n(.*?)```", re.DOTALL)


@pytest.mark.parametrize("shown", _SHOWN.findall(PLAN_DOC), ids=lambda shown: shown[0][18:])
def test_every_plan_output_shown_after_its_command_is_the_command_s(shown: tuple[str, str]) -> None:
    """A ``lightning-cp plan`` command in docs/plan.md and the output shown under it (GLM-5's): the command's,
    line for line; a ``...`` line stands for lines left out between a head and a tail that are the output's."""
    command, text = shown
    model, *argv = shlex.split(command)[2:]
    actual = _plan(Path(model).name, *argv).rstrip("\n").splitlines()
    lines = text.rstrip("\n").splitlines()
    head, tail = (
        (lines[: lines.index("...")], lines[lines.index("...") + 1 :]) if "..." in lines else (lines, [])
    )
    assert actual[: len(head)] == head
    assert not tail or actual[-len(tail) :] == tail
    assert tail or len(actual) == len(head)
