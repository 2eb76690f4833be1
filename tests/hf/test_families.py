"""Every decoder family of ``transformers``' causal-LM auto mapping trains exactly under CP, or is refused at setup.

The families are those of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` less the rule's exclusions
(``tests/hf/_families.py``); each gets a tiny random config and runs at cp = 2 on the shared gloo pool
(``tests/hf/_matrix.py``): the strategy's setup check, then one forward and backward of
``HFCausalLM.training_step`` against ``transformers``' own ``model(input_ids, labels=...)`` with the
family's default attention. The expected outcome of each family and real-config variant is one table,
``tests/hf/support_table.py``, which the support table of ``docs/hf.md`` is rendered from.
"""

from __future__ import annotations

import torch

from tests.hf import _matrix, support_table
from tests.hf._families import families

LOSS_RTOL = 1e-5
# Per parameter, in norm: a gradient within 5e-5 of the reference's norm (fp32 round-off of sums over a
# few dozen tokens is ~1e-6 .. 2e-5), or, for gradients that are zero up to round-off (a key bias, whose
# softmax makes it irrelevant), within 1e-6 of the whole model's gradient norm. A 1% error fails either.
GRAD_RTOL = 5e-5
GRAD_FLOOR = 1e-6


def _cases() -> list[tuple[str, str, dict]]:
    cases = [(name, name, {}) for name in support_table.EXPECTED]
    cases += [(name, v.model_type, v.fields) for name, v in support_table.VARIANTS.items()]
    return cases


def _expected(name: str) -> support_table.Outcome:
    variant = support_table.VARIANTS.get(name)
    return support_table.EXPECTED[name] if variant is None else variant.outcome


def _failure(name: str, ranks: list[dict], expected: support_table.Outcome) -> str | None:
    """Why ``name``'s outcome on the CP ranks is not ``expected``, or ``None``."""
    first = ranks[0]
    if "crash" in first or any("crash" in r for r in ranks):
        return f"crashed: {next(r['crash'] for r in ranks if 'crash' in r)}"
    if "refused" in first:
        if expected.exact:
            return f"refused, expected exact: {first['refused']}"
        if expected.reason.message not in first["refused"]:
            return f"refused for another reason than {expected.reason.message!r}: {first['refused']}"
        return None
    if not expected.exact:
        return f"accepted, expected refused ({expected.reason.message!r})"
    reference = next(r["expected"] for r in ranks if "expected" in r)
    if not torch.allclose(first["loss"], reference["loss"], rtol=LOSS_RTOL, atol=0.0):
        return f"loss {first['loss'].item():.8f} != {reference['loss'].item():.8f}"
    total = torch.cat(list(reference["grads"].values())).norm()
    for key, want in reference["grads"].items():
        error = (first["grads"][key] - want).norm()
        if error > GRAD_RTOL * want.norm() + GRAD_FLOOR * total:
            return f"gradient of {key}: error {error:.3e}, reference norm {want.norm():.3e}"
    return None


def test_the_families_are_the_auto_mapping_less_the_rule_s_exclusions():
    import transformers

    assert transformers.__version__ == support_table.TRANSFORMERS_VERSION, (
        f"the support table lists transformers {support_table.TRANSFORMERS_VERSION}'s families, this is "
        f"{transformers.__version__}: install the test extra's pin, or update the table for this release"
    )
    kept, excluded = families()
    assert sorted(support_table.EXPECTED) == kept, "families with no expected outcome, or outcomes of others"
    assert len(kept) + len(excluded) == len(set(kept) | set(excluded))
    assert {"llama", "qwen3", "gemma3_text", "mistral", "gpt2", "falcon", "qwen3_5_text"} <= set(kept)
    assert excluded["bert"].startswith("a bidirectional encoder")
    assert excluded["gemma3"].startswith("composite")
    assert excluded["bart"].startswith("encoder-decoder")


def test_every_family_trains_exactly_at_cp2_or_is_refused_with_its_reason(world2):
    results = world2.run(_matrix.run, _cases())
    failures = []
    for name, _, _ in _cases():
        failure = _failure(name, [rank[name] for rank in results], _expected(name))
        if failure is not None:
            failures.append(f"{name}: {failure}")
    assert not failures, "\n".join(failures)


def test_the_readme_table_is_current():
    assert support_table.documented_table() == support_table.render(), (
        "docs/hf.md's support table is stale: run `python -m tests.hf.support_table`"
    )
