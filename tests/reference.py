"""`transformers` as the correctness reference (tests only, never the serving path)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

# The formats identity tests pin (issue 20), so that CI on any CPU computes the same numbers: fp32
# arithmetic over unquantized weights held at fp16 for the decode product, what `--dtype auto`
# serves on a CPU without native bf16. Tests comparing with transformers token for token hold the
# weights exact (EXACT_FORMATS: what `--dtype float32 --quantization none` means on its own).
PINNED_FORMATS = {"dtype": "float32", "quantization": "none", "cpu_weights": "fp16"}
EXACT_FORMATS = {**PINNED_FORMATS, "cpu_weights": "fp32"}
# The same as worker flags.
PINNED_FLAGS = [arg for name, value in PINNED_FORMATS.items() for arg in (f"--{name.replace('_', '-')}", value)]


@dataclass(frozen=True)
class ReferenceRun:
    """Greedy tokens from transformers and, per step, the top-2 logit margin."""

    token_ids: list[int]
    margins: list[float]


def load_reference_model(model_path: str):
    """transformers' own GGUF loader dequantizes the same file into fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(model_path), gguf_file=os.path.basename(model_path), dtype=torch.float32
    )
    return model.eval()


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], max_tokens: int) -> ReferenceRun:
    """Greedy decoding with transformers' KV cache, ignoring EOS, recording top-2 margins."""
    out = model(torch.tensor([prompt]), use_cache=True, logits_to_keep=1)  # only the last position's are read
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(max_tokens):
        logits = out.logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        token = int(logits.argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]]), cache=out.cache, use_cache=True)
    return ReferenceRun(tokens, margins)


NEAR_TIE = 1e-3


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    """Index of the first differing token, or None if identical."""
    for i, (a, b) in enumerate(zip(ours, reference, strict=False)):
        if a != b:
            return i
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def check_against(
    outputs: list[list[int]], references: list[list[int]], margins: list[list[float]], label: str
) -> list[str]:
    """Assert outputs equal references except near-ties; return a report of accepted divergences.

    A divergence is accepted only where the reference's top-2 margin at the first differing
    token is below NEAR_TIE (fp32 matmuls of different batch shapes differ in the last bits),
    and at most one prompt may diverge.
    """
    report = []
    for i, (ours, ref, margin) in enumerate(zip(outputs, references, margins, strict=True)):
        at = first_divergence(ours, ref)
        if at is None:
            continue
        assert at < len(margin) and margin[at] < NEAR_TIE, (
            f"{label}: prompt {i} diverges at token {at} (ours {ours[at:at + 4]}, reference {ref[at:at + 4]}) "
            f"where the reference's top-2 margin is {margin[at] if at < len(margin) else 'n/a'}, not a near-tie"
        )
        report.append(f"{label}: prompt {i} diverges at token {at}, a near-tie (margin {margin[at]:.2e})")
    assert len(report) <= 1, f"{label}: more than one prompt diverged: {report}"
    for line in report:
        print(line)
    return report


def engine_reference(engine, prompts: list[list[int]], params: list) -> list[ReferenceRun]:
    """Greedy tokens of prompts run together on an in-process engine, with its top-2 margins per step
    (from its top-2 logprobs: the same difference as the logits'), for check_runs."""
    from engine.offline import generate

    completions = generate(engine, prompts, [replace(p, logprobs=max(p.logprobs or 0, 2)) for p in params])
    return [ReferenceRun(c.token_ids, margins_of(c)) for c in completions]


def margins_of(completion) -> list[float]:
    """The top-2 margin per generated token of an engine Completion asked for logprobs >= 2."""
    return [top[0][1] - top[1][1] for top in (lp.top for lp in completion.logprobs)]


def check_runs(outputs: list[list[int]], references: list[ReferenceRun], label: str) -> list[str]:
    """check_against for ReferenceRuns: equal tokens except a near-tie at the first divergence."""
    return check_against(outputs, [r.token_ids for r in references], [r.margins for r in references], label)


def check_text(text: str, reference: ReferenceRun, decode, label: str) -> None:
    """The near-tie rule where only the text came back: `text` equals the reference's decoded text,
    or departs from it inside the first reference token whose top-2 margin is a near-tie."""
    expected = decode(reference.token_ids)
    if text == expected:
        return
    same = next((i for i, (a, b) in enumerate(zip(text, expected, strict=False)) if a != b),
                min(len(text), len(expected)))
    at = next(i for i in range(len(reference.token_ids) + 1)
              if i == len(reference.token_ids) or len(decode(reference.token_ids[:i + 1])) > same)
    assert at < len(reference.margins) and reference.margins[at] < NEAR_TIE, (
        f"{label}: the text departs at character {same} ({text[same:same + 20]!r} against "
        f"{expected[same:same + 20]!r}), in reference token {at}, not a near-tie")
    print(f"{label}: the text departs at reference token {at}, a near-tie (margin {reference.margins[at]:.2e})")
