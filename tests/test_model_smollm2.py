"""SmolLM2-135M (the default GGUF) against transformers loading the same file: logits, greedy
tokens, tokenizer."""

from __future__ import annotations

import pytest
import torch

import kernels.native
from model import Engine, KVPool, SamplingParams, load_model
from model.fetch import smollm2_path

pytestmark = pytest.mark.skipif(
    not smollm2_path().exists(), reason="SmolLM2 GGUF not fetched (make setup)"
)

TEXT = (
    "The history of the Roman Empire spans centuries of conquest, culture and law. Its roads "
    "connected distant provinces, and its engineers built aqueducts that carried water across "
    "valleys. Latin, the language of Rome, shaped many modern languages. Historians still debate "
    "why the western half fell in the fifth century while the eastern half endured for another "
    "thousand years, until Constantinople fell in 1453."
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def models():
    # One thread: on this shared 2-core machine a second OpenMP thread stalls on every small op when
    # the other core is busy, which makes decode ~20x slower; restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    yield load_model("smollm2-135m"), hf, hf_tok
    torch.set_num_threads(threads)


def test_config(models):
    lm, hf, _ = models
    c = lm.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.tie_word_embeddings and c.max_position_embeddings == hf.config.max_position_embeddings
    assert lm.tokenizer.eos_token_ids == {hf.generation_config.eos_token_id}


def test_tokenizer_matches_transformers(models):
    lm, _, hf_tok = models
    for text in [
        TEXT,
        "Numbers 1234567 and  spaces\n\n\ttabs ünïcödé 🙂",
        "<|im_start|>user\nhi<|im_end|>",
    ]:
        assert lm.tokenizer.encode(text) == hf_tok(text, add_special_tokens=False).input_ids
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    hf_text = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert lm.tokenizer.render_chat(msgs) == hf_text
    assert (
        lm.tokenizer.apply_chat_template(msgs)
        == hf_tok(hf_text, add_special_tokens=False).input_ids
    )


def test_logits_match_transformers(models):
    lm, hf, _ = models
    ids = lm.tokenizer.encode(TEXT)[:64]
    assert len(ids) == 64
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    pool = KVPool(lm.config, 4, 16)
    ours = lm.model.prefill(torch.tensor(ids), pool, pool.allocate(4))
    assert (ours - ref).abs().max().item() <= 1e-3


def test_greedy_tokens_match_transformers(models):
    lm, hf, _ = models
    prompts = [lm.tokenizer.encode(p) for p in PROMPTS]
    ours = Engine(lm).generate_batch(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for ids, out in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=2,
            )
        assert out == ref[0, len(ids) :].tolist()
    assert "Paris" in lm.tokenizer.decode(ours[0][:8])


def test_prefill_chunked_and_cached_prefix_agree(models):
    lm, _, _ = models
    ids = lm.tokenizer.encode(TEXT)[:60]
    pool = KVPool(lm.config, 16, 16)
    whole = lm.model.prefill(torch.tensor(ids), pool, pool.allocate(4), last_only=True)[0]
    table = pool.allocate(4)
    for s in range(0, 60, 23):
        chunked = lm.model.prefill(
            torch.tensor(ids[s : s + 23]), pool, table, start_pos=s, last_only=True
        )[0]
    assert (chunked - whole).abs().max().item() <= 1e-4
    cached = lm.model.prefill(torch.tensor(ids[37:]), pool, table, start_pos=37, last_only=True)[
        0
    ]  # prefix already there
    assert (cached - whole).abs().max().item() <= 1e-4


def test_bf16_prefill_reads_a_cached_prefix_as_it_would_recompute_it(models):
    """bf16 (the cluster's dtype on CPUs with native bf16): a prompt prefilled whole and in
    chunks that read their prefix back from the pool agree, and both stay close to fp32. With
    the fused bf16 prefill attention (kernels/prefill_attn.py) a row's result does not
    depend on where a chunk starts: the logits are equal, not only close."""
    lm, _, _ = models
    bf = load_model("smollm2-135m", dtype=torch.bfloat16)
    ids = lm.tokenizer.encode(TEXT)[:70]

    def logits(model, dtype, chunks):
        pool = KVPool(model.config, 6, 16, dtype=dtype)
        table, out, s = pool.allocate(5), [], 0
        for n in chunks:
            out.append(model.model.prefill(torch.tensor(ids[s : s + n]), pool, table, start_pos=s))
            s += n
        return torch.cat(out)

    ref = logits(lm, torch.float32, [70])
    whole, chunked = logits(bf, torch.bfloat16, [70]), logits(bf, torch.bfloat16, [33, 20, 17])
    if kernels.native.prefill_attention_available():
        assert torch.equal(whole, chunked)
    # measured 0.017 (fused attention) and 0.018-0.019 (SDPA) on 160 tokens of a novel
    for got in (whole, chunked):
        assert (got - ref).norm() / ref.norm() < 0.03
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_a_random_model_of_smollm2s_shape_loads_with_its_tokenizer(models, tmp_path):
    """bench/random_model.py: a HF directory of a named shape (config, bf16 weights as
    tiny_random_weights draws them, SmolLM2's tokenizer) that load_model takes as a checkpoint,
    so that the benchmarks can run models of other sizes than the one that ships."""
    from bench.random_model import SHAPES, write_random_model
    from model.loader import tiny_random_weights

    path = write_random_model("smollm2", tmp_path / "m", torch.bfloat16, seed=3)
    lm = load_model(str(path), dtype="bfloat16")
    ours = models[0]
    for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        assert getattr(lm.config, field) == getattr(ours.config, field)
    assert lm.config.vocab_size == ours.tokenizer.vocab_size == SHAPES["smollm2"]["vocab_size"]
    assert lm.config.eos_token_ids == ours.config.eos_token_ids
    assert lm.tokenizer.encode(TEXT) == ours.tokenizer.encode(TEXT)
    want = tiny_random_weights(lm.config, 3, torch.bfloat16)
    got = lm.model.hf_state_dict()
    for name in ("model.embed_tokens.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(got[name], want[name])
    logits = lm.model.prefill(torch.tensor(lm.tokenizer.encode(TEXT)), *_pool_for(lm, 96))
    assert torch.isfinite(logits).all()


def _pool_for(lm, tokens: int):
    pool = KVPool(lm.config, -(-tokens // 16), 16, torch.bfloat16)
    return pool, pool.allocate(pool.blocks_for(tokens))
