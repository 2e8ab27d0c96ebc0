"""StreamingLLM through the mesh: a prefill and a decode worker with --kv-sliding-window and
--kv-sink-tokens on a random Llama of 64 positions, behind a gateway whose --max-model-len (like the
workers') is four times that: a conversation past the context answers as an in-process engine of the
same flags, and one past the bound is refused naming it."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from reference import EXACT_FORMATS, ReferenceRun, check_runs, engine_reference
from shared_pool import NO_SLO
from transformers import LlamaConfig

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.sampling_params import SamplingParams
from harness.ports import free_port
from harness.worker import start_worker
from services.client import TandemClient
from tests.unit.test_model_hf import VOCAB, random_prompt, save_random_model, save_word_tokenizer

CONTEXT, MAX_MODEL_LEN = 64, 256
ENGINE = dict(block_size=8, num_blocks=64, sliding_window=24, sink_tokens=8)
GREEDY = {"max_tokens": 100, "temperature": 0.0, "ignore_eos": True}


def engine_flags(model: Path) -> list[str]:
    formats = [arg for name, value in EXACT_FORMATS.items() for arg in (f"--{name.replace('_', '-')}", value)]
    return ["--model", str(model), *formats, "--threads", "1", "--block-size", "8", "--kv-cache-blocks", "64",
            "--kv-sliding-window", "24", "--kv-sink-tokens", "8", "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-batched-tokens", "16"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("llama64")
    save_random_model(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                  initializer_range=0.1), directory)
    save_word_tokenizer(directory, VOCAB)
    return directory


def test_a_conversation_past_the_context_through_prefill_and_decode_workers(model: Path) -> None:
    ports = {role: free_port() for role in ("prefill", "decode")}
    workers = [start_worker([role, "--port", str(port), *engine_flags(model)], wait=False)
               for role, port in ports.items()]
    gateway = start_worker(["gateway", "--port", "0", "--model", str(model), "--max-model-len", str(MAX_MODEL_LEN),
                            "--prefill", f"127.0.0.1:{ports['prefill']}", "--decode", f"127.0.0.1:{ports['decode']}",
                            *NO_SLO], wait=False)
    try:
        for process in (*workers, gateway):
            process.wait_ready()
        prompts = [random_prompt(90, seed=2), random_prompt(20, seed=3)]  # the first alone outgrows the context
        local = Engine(EngineConfig(model=str(model), **EXACT_FORMATS, max_model_len=MAX_MODEL_LEN,
                                    cache=CacheConfig(**ENGINE), scheduler=SchedulerConfig(max_num_batched_tokens=16)))
        expected: list[ReferenceRun] = engine_reference(local, prompts, [SamplingParams(**GREEDY)] * len(prompts))
        with TandemClient(str(gateway.address)) as client:
            got = [[t for chunk in client.generate(token_ids=p, **GREEDY, timeout=300) for t in chunk.token_ids]
                   for p in prompts]
            check_runs(got, expected, "StreamingLLM through a prefill and a decode worker")
            with pytest.raises(grpc.RpcError) as refused:
                list(client.generate(token_ids=random_prompt(200, seed=4), max_tokens=60, timeout=60))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert f"limit of {MAX_MODEL_LEN} total tokens (max_model_len)" in refused.value.details()
    finally:
        codes = [process.stop() for process in (gateway, *workers)]
    assert codes == [0, 0, 0]
