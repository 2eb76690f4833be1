"""Every decoder family of ``transformers``' causal-LM auto mapping trains exactly under CP, or is refused at setup.

The families are those of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` less the rule's exclusions
(``tests/hf/_families.py``); each gets a tiny random config and runs at cp = 2 on the shared gloo pool
(``tests/hf/_matrix.py``): the strategy's setup check, then one forward and backward of
``HFCausalLM.training_step`` against ``transformers``' own ``model(input_ids, labels=...)`` with the
family's default attention. The expected outcome of each family and real-config variant is one table,
``tests/hf/support_table.py``, which the support table of ``docs/hf.md`` is rendered from.
"""

from __future__ import annotations

from tests.hf import _matrix, support_table
from tests.hf._families import families


def _cases() -> list[tuple[str, str, dict]]:
    cases = [(name, name, {}) for name in support_table.EXPECTED]
    cases += [(name, v.model_type, v.fields) for name, v in support_table.VARIANTS.items()]
    return cases


def _expected(name: str) -> support_table.Outcome:
    variant = support_table.VARIANTS.get(name)
    return support_table.EXPECTED[name] if variant is None else variant.outcome


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
        failure = _matrix.failure(name, [rank[name] for rank in results], _expected(name))
        if failure is not None:
            failures.append(f"{name}: {failure}")
    assert not failures, "\n".join(failures)


def test_the_readme_table_is_current():
    assert support_table.documented_table() == support_table.render(), (
        "docs/hf.md's support table is stale: run `python -m tests.hf.support_table`"
    )
