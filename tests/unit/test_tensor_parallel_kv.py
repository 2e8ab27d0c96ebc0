"""KV pages between engines of different tensor-parallel layouts (engine.parallel.kv_heads), moved by
hand inside one process (tests.disaggregated) while each engine's other ranks are real processes
(gloo): a prefill engine's pages carry every KV head whatever its size, and a decode engine's ranks
each take their own, so every pairing decodes as the one-process engine does. The shipped model at
TP 3 on either side, and a random model whose 2 KV heads are replicated at TP 4 (comparing layouts of
the same weights is the point), in int8 and int4 KV caches so the scales travel with their heads."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.offline import generate
from engine.outputs import KVReservation
from engine.parallel.kv_heads import kv_head_ranges
from engine.sampling_params import SamplingParams
from tests.disaggregated import import_all, prefill_into, run_disaggregated
from tests.reference import check_against
from tests.unit.test_model_hf import save_random_model, save_word_tokenizer

pytestmark = pytest.mark.ranks

PROMPTS = [[1, 504, 3458, 314, 260, 4649, 282, 4760, 30, 378, 1112, 2273, 1597, 28, 357, 2600, 253],
           list(range(100, 141))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)


@contextlib.contextmanager
def _engines(*configs: EngineConfig, files=None) -> Iterator[list[Engine]]:
    engines: list[Engine] = []
    try:
        for config in configs:
            engines.append(Engine(config, files=files))
        yield engines
    finally:
        for engine in engines:
            engine.close()


def _holds_nothing(engines: list[Engine]) -> bool:
    """Every block of every engine is free (or only in the prefix cache)."""
    return all(e.kv.num_free_blocks == e.kv.num_blocks and not e.scheduler.requests for e in engines)


def _margins(completion) -> list[float]:
    return [top[0][1] - top[1][1] for top in (logprob.top for logprob in completion.logprobs)]


def test_each_rank_holds_its_kv_heads_and_replicas_hold_copies(model_files):
    assert kv_head_ranges(model_files.config, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert kv_head_ranges(model_files.config, 9) == [range(h, h + 1) for h in (0, 0, 0, 1, 1, 1, 2, 2, 2)]
    assert kv_head_ranges(model_files.config, 1) == [range(0, 3)]


# Prefill TP 1 -> decode TP 3 runs as worker processes (tests/integration/test_tensor_parallel_mesh.py).
@pytest.mark.parametrize(("prefill_size", "decode_size"), [(3, 1)])
def test_the_shipped_model_moves_between_layouts_and_decodes_as_one_process(prefill_size, decode_size, model_files):
    config = EngineConfig(dtype="float32", quantization="none", cpu_weights="fp32", cache=CacheConfig(num_blocks=32))
    whole = generate(Engine(config, files=model_files), PROMPTS, GREEDY)
    with _engines(replace(config, role="prefill", tensor_parallel_size=prefill_size),
                  replace(config, role="decode", tensor_parallel_size=decode_size),
                  files=model_files) as (prefill, decode):
        moved = run_disaggregated(prefill, decode, PROMPTS, GREEDY)
        assert _holds_nothing([prefill, decode])
    check_against(moved, [c.token_ids for c in whole], [_margins(c) for c in whole],
                  f"prefill TP {prefill_size} -> decode TP {decode_size}")


# int4's scales belong to groups of 16 elements of a row: head_dim 32 gives it two per row and head.
@pytest.mark.parametrize(("kv_cache_dtype", "head_dim"), [("int8", 16), ("int4", 32)])
def test_a_random_model_with_replicated_kv_heads_moves_quantized_pages_between_tp_4_and_tp_2(
        tmp_path: Path, kv_cache_dtype: str, head_dim: int):
    save_random_model(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=head_dim,
                                  max_position_embeddings=128, initializer_range=0.1), tmp_path)
    save_word_tokenizer(tmp_path, 96)
    config = EngineConfig(model=str(tmp_path), dtype="float32", quantization="none", cpu_weights="fp32",
                          kv_cache_dtype=kv_cache_dtype, cache=CacheConfig(num_blocks=16))
    prompts = [[int(t) for t in torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (21, 35)]
    whole = generate(Engine(config), prompts, GREEDY)
    with _engines(replace(config, role="prefill", tensor_parallel_size=4),
                  replace(config, role="decode", tensor_parallel_size=2),
                  replace(config, role="prefill", tensor_parallel_size=2),
                  replace(config, role="decode", tensor_parallel_size=4)) as engines:
        gathered = run_disaggregated(engines[0], engines[1], prompts, GREEDY)
        scattered = run_disaggregated(engines[2], engines[3], prompts, GREEDY)
        assert _holds_nothing(engines)
    expected = [c.token_ids for c in whole]
    check_against(gathered, expected, [_margins(c) for c in whole], "prefill TP 4 (replicated) -> decode TP 2")
    check_against(scattered, expected, [_margins(c) for c in whole], "prefill TP 2 -> decode TP 4 (replicated)")


def test_pages_imported_on_another_thread_while_a_step_runs_reach_every_rank_in_order(tmp_path: Path):
    """A decode worker writes received pages on its receiver's thread, beside the engine thread's
    steps (engine.commands.ImportPages): at TP > 1 both send the other ranks plans over one group,
    so a request's import must land between steps, never inside one."""
    save_random_model(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, initializer_range=0.1), tmp_path)
    save_word_tokenizer(tmp_path, 96)
    config = EngineConfig(model=str(tmp_path), dtype="float32", quantization="none", cpu_weights="fp32",
                          cache=CacheConfig(num_blocks=32))
    prompts = [[int(t) for t in torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (30, 40)]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    whole = [c.token_ids for c in generate(Engine(config), prompts, long)]
    with _engines(replace(config, role="prefill"), replace(config, role="decode", tensor_parallel_size=2)) as engines:
        prefill, decode = engines
        # Both prompts' pages, computed before any import.
        prefilled = [prefill_into(prefill, f"r{index}", prompt, long) for index, prompt in enumerate(prompts)]
        firsts, pages = [first for first, _ in prefilled], [collected for _, collected in prefilled]
        tokens, reservations = {}, []
        for index, prompt in enumerate(prompts):
            reservation = decode.reserve(f"r{index}", prompt, long)
            assert isinstance(reservation, KVReservation)
            reservations.append(reservation)
            if index == 0:
                import_all(decode, reservation, pages[0], 2)
                tokens["r0"] = list(decode.start_decode("r0", firsts[0]).new_token_ids)
        # r0 decodes on this thread while r1's pages land from another, many times over.
        r1, blocks = reservations[1], reservations[1].blocks_to_fill
        r1_pages = [pages[1].layer(layer, len(blocks)) for layer in range(2)]
        importer = threading.Thread(target=lambda: [decode.import_kv(r1, layer, blocks, *r1_pages[layer])
                                                    for _ in range(20) for layer in range(2)])
        importer.start()
        while importer.is_alive():
            for output in decode.step():
                tokens[output.request_id] += list(output.new_token_ids)
        importer.join()
        tokens["r1"] = list(decode.start_decode("r1", firsts[1]).new_token_ids)
        while decode.has_unfinished():
            for output in decode.step():
                tokens[output.request_id] += list(output.new_token_ids)
        assert _holds_nothing(engines)
    assert [tokens["r0"], tokens["r1"]] == whole
