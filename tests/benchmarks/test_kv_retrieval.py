"""The fidelity suite's long-context retrieval check: its planted-fact prompts and its table."""

from __future__ import annotations

from bench.common.model_quality import FIXED_TEXT
from bench.fidelity.formats import FORMATS
from bench.fidelity.long_text import long_text_table
from bench.fidelity.report import retrieval_table
from bench.fidelity.retrieval import QUESTION, planted_prompts


def test_each_prompt_is_exactly_its_length_with_its_fact_at_its_depth_then_the_question(tokenizer):
    filler = FIXED_TEXT.read_text(encoding="utf-8")
    prompts = planted_prompts(tokenizer, filler, 256, 4)
    assert [len(p.token_ids) for p in prompts] == [256] * 4
    assert len({p.code for p in prompts}) == 4 and all(len(p.code) == 4 for p in prompts)
    for prompt in prompts:
        text = tokenizer.decode(prompt.token_ids)
        assert text.endswith(QUESTION) and text.count(f"The secret code is {prompt.code}.") == 1
        # The fact sits where its depth says, at a sentence end: the filler before it ends one.
        before = text[:text.index(f" The secret code is {prompt.code}.")]
        assert before.rstrip().endswith((".", "!", "?"))
    assert [p.depth for p in prompts] == sorted(p.depth for p in prompts)
    assert planted_prompts(tokenizer, filler, 256, 4) == prompts  # every row answers the same prompts


def test_the_table_counts_hits_per_length_and_says_why_a_row_has_none():
    rows = [f for f in FORMATS if f.retrieval]
    assert [f.name for f in rows] == ["fp32", "kv-fp8", "kv-int8", "kv-int4", "kv-window"]
    results = {"fp32": {"hits": {"256": [True, True, False], "512": [True, False, False]}},
               "kv-fp8": {"skipped": "kv_cache_dtype: no kernel"}}
    table = retrieval_table(rows[:2], results, [256, 512]).splitlines()
    assert table[2] == "| fp32 | 2 of 3 | 1 of 3 |"
    assert table[3] == "| kv-fp8 | - | - | kv_cache_dtype: no kernel"


def test_the_long_text_table_has_a_line_per_segment_and_a_dash_past_where_a_row_stops():
    table = long_text_table(["fp32", "kv-window"], {"fp32": [20.0], "kv-window": [21.004, 19.5]}, 1500, 1024)
    assert table.splitlines()[2:] == ["| 0-1023 | 20.00 | 21.00 |", "| 1024-1499 | - | 19.50 |"]
