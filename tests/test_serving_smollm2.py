"""The cluster on the real default model (SmolLM2-135M): greedy answers equal the single-process
engine's."""

from __future__ import annotations

import pytest

from model import Engine, SamplingParams, load_model
from model.fetch import smollm2_path
from tests.serving_cluster import Cluster

pytestmark = pytest.mark.skipif(
    not smollm2_path().exists(), reason="SmolLM2 not fetched (make model)"
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at",
    "The three primary colors are",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn:",
    "The largest planet in the solar system is",
    "To make a cup of tea, first",
    "Photosynthesis is the process by which",
    "Translate to French: good morning",
]


@pytest.fixture(scope="module")
def lm():
    return load_model("smollm2-135m")


def test_ten_prompts_equal_local_generate(lm):
    engine = Engine(lm, block_size=16)
    with Cluster(lm) as c:
        for i, p in enumerate(PROMPTS):
            chat = i % 2 == 1  # half through the chat template, as `halfmoon generate --chat` does
            fields = {"messages": [{"role": "user", "content": p}]} if chat else {"text": p}
            ids, text, last = c.generate(max_tokens=8, ignore_eos=False, **fields)
            prompt_ids = (
                lm.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                if chat
                else lm.tokenizer.encode(p)
            )
            want = engine.generate(prompt_ids, SamplingParams(max_tokens=8))
            assert ids == want, p
            assert text == lm.tokenizer.decode(want)
            assert last.usage.prompt_tokens == len(prompt_ids)
        _, text, _ = c.generate(text=PROMPTS[0], max_tokens=3, ignore_eos=False)
        assert "Paris" in text
