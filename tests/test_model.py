"""The model engine on tiny-random: transformers parity, paged prefill/decode agreement, pool,
sampling, loaders."""

from __future__ import annotations

import json

import pytest
import torch

from model import (
    MODEL_NAMES,
    Engine,
    KVPool,
    PoolExhausted,
    SamplingParams,
    load_model,
    sample,
    save_hf_dir,
)


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def oracle(lm, tmp_path_factory):
    """transformers' LlamaForCausalLM on the same weights, fp32."""
    from transformers import AutoModelForCausalLM

    path = save_hf_dir(lm, tmp_path_factory.mktemp("tiny"))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# bf16 moves tiny-random's logits (scale ~6) by up to ~0.2; the argmax flips only where the
# oracle's top-2 margin is smaller (seen: up to 0.11), so agreement is asserted above this one.
ARGMAX_MARGIN = 0.2


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _prefill_all(lm, ids: list[int], num_blocks: int = 32, block_size: int = 16):
    pool = KVPool(lm.config, num_blocks, block_size)
    table = pool.allocate(pool.blocks_for(len(ids)))
    return lm.model.prefill(torch.tensor(ids), pool, table), pool, table


def test_registry_and_config(lm):
    assert "tiny-random" in MODEL_NAMES and "smollm2-135m" in MODEL_NAMES
    c = lm.config
    assert 2 <= c.num_layers <= 4 and c.num_kv_heads < c.num_heads  # GQA
    again = load_model("tiny-random")
    assert again.fingerprint == lm.fingerprint  # deterministic seeded weights
    assert again.weights_id == lm.weights_id and len(lm.weights_id) == 32
    ours, theirs = lm.model.hf_state_dict(), again.model.hf_state_dict()  # packed or not
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert len(lm.fingerprint) == 32 and int(lm.fingerprint, 16) >= 0


def test_logits_match_transformers(lm, oracle):
    hf = oracle
    ids = _prompt(64, 1, lm.config.vocab_size)
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    ours, _, _ = _prefill_all(lm, ids)
    assert ours.shape == ref.shape == (64, lm.config.vocab_size)
    assert (ours - ref).abs().max().item() <= 1e-3
    # Greedy tokens of the engine equal transformers' greedy generate.
    with torch.inference_mode():
        hf_out = hf.generate(
            torch.tensor([ids[:20]]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    ours_out = Engine(lm).generate(ids[:20], SamplingParams(max_tokens=24, ignore_eos=True))
    assert ours_out == hf_out[0, 20:].tolist()


def test_hf_directory_round_trip(lm, tmp_path):
    path = save_hf_dir(lm, tmp_path / "tiny")
    back = load_model(str(path))
    ids = _prompt(40, 2, lm.config.vocab_size)
    a, _, _ = _prefill_all(lm, ids)
    b, _, _ = _prefill_all(back, ids)
    assert torch.equal(a, b)
    assert back.config.num_kv_heads == lm.config.num_kv_heads
    text = "héllo <|im_start|> 42"
    assert back.tokenizer.encode(text) == lm.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert back.tokenizer.apply_chat_template(msgs) == lm.tokenizer.apply_chat_template(msgs)


def test_a_bf16_checkpoint_loads_as_its_fp32_copy_rounds(lm, tmp_path):
    """Tensors are read as the loader asks for them, in the file's own dtype (model.loader's
    LazyWeights and safetensors reader): a bf16 checkpoint gives the bits of the fp32 one rounded
    to bf16, loaded in bf16, and the same values again in fp32."""
    from safetensors.torch import load_file, save_file

    path = save_hf_dir(lm, tmp_path / "fp32")
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            (bf16 / f.name).write_bytes(f.read_bytes())
    halved = {k: t.bfloat16() for k, t in load_file(str(path / "model.safetensors")).items()}
    save_file(halved, str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    ids = _prompt(40, 4, lm.config.vocab_size)
    a, _, _ = _prefill_all(load_model(str(path), dtype="bfloat16"), ids)
    b, _, _ = _prefill_all(load_model(str(bf16), dtype="bfloat16"), ids)
    assert torch.equal(a, b)
    back = load_model(str(bf16), dtype="float32").model.hf_state_dict()
    assert all(torch.equal(back[k], t.float()) for k, t in halved.items())


def _corrupt_copies(path, tmp_path):
    """(what was done, a copy of the checkpoint directory `path` with its weights so damaged)."""
    raw = (path / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4  # one tensor claims bytes that are not its own
    longer = json.dumps(header).encode()
    damaged = {
        "truncated": raw[: len(raw) - 100],
        "garbage header length": (1 << 40).to_bytes(8, "little") + raw[8:],
        "header not JSON": raw[:8] + b"\xff" * n + raw[8 + n :],
        "offsets past a tensor's size": len(longer).to_bytes(8, "little") + longer + raw[8 + n :],
    }
    for what, data in damaged.items():
        d = tmp_path / what.replace(" ", "-")
        d.mkdir()
        for f in path.iterdir():
            (d / f.name).write_bytes(data if f.suffix == ".safetensors" else f.read_bytes())
        yield what, d


def test_a_corrupt_safetensors_file_is_an_error_naming_it(lm, tmp_path):
    path = save_hf_dir(lm, tmp_path / "good")
    for what, d in _corrupt_copies(path, tmp_path):
        with pytest.raises(ValueError, match="corrupt safetensors file") as e:
            load_model(str(d))
        assert str(d) in str(e.value), what


@pytest.mark.parametrize("block_size", [16, 5])
def test_prefill_whole_chunked_and_cached_prefix_agree(lm, block_size):
    ids = _prompt(70, 3, lm.config.vocab_size)
    whole, _, _ = _prefill_all(lm, ids, block_size=block_size)

    # In chunks (chunk edges off block boundaries), all positions.
    pool = KVPool(lm.config, 32, block_size)
    table = pool.allocate(pool.blocks_for(len(ids)))
    parts = [
        lm.model.prefill(torch.tensor(ids[s : s + 13]), pool, table, start_pos=s)
        for s in range(0, 70, 13)
    ]
    chunked = torch.cat(parts)
    assert (chunked - whole).abs().max().item() <= 1e-4

    # A cached prefix of 37 tokens moved into other blocks of another pool, then the suffix.
    src = KVPool(lm.config, 32, block_size)
    src_table = src.allocate(src.blocks_for(37))
    lm.model.prefill(torch.tensor(ids[:37]), src, src_table)
    dst = KVPool(lm.config, 40, block_size)
    dst.allocate(3)  # so that the blocks differ from the source's
    dst_table = dst.allocate(dst.blocks_for(len(ids)))
    n_prefix = src.blocks_for(37)
    dst.kv[dst_table[:n_prefix]] = src.kv[src_table]
    suffix = lm.model.prefill(torch.tensor(ids[37:]), dst, dst_table, start_pos=37, last_only=True)
    assert suffix.shape == (1, lm.config.vocab_size)
    assert (suffix[0] - whole[-1]).abs().max().item() <= 1e-4


def test_on_layer_done_sees_that_layers_kv_written(lm):
    ids = _prompt(20, 4, lm.config.vocab_size)
    pool = KVPool(lm.config, 8, 16)
    table = pool.allocate(2)
    seen = []

    def on_layer(layer: int) -> None:
        seen.append(
            (layer, pool.kv[table, layer].clone(), pool.kv[table, layer + 1 :].abs().sum().item())
        )

    lm.model.prefill(torch.tensor(ids), pool, table, on_layer_done=on_layer)
    assert [s[0] for s in seen] == list(range(lm.config.num_layers))
    for layer, snapshot, later in seen:
        assert torch.equal(
            snapshot, pool.kv[table, layer]
        )  # the final KV of that layer was already there
        assert snapshot.abs().sum() > 0
        assert later == 0  # later layers not yet written


def test_decode_matches_prefill_logits(lm):
    ids = _prompt(45, 5, lm.config.vocab_size)
    whole, _, _ = _prefill_all(lm, ids)
    pool = KVPool(lm.config, 8, 16)
    table = pool.allocate(3)
    lm.model.prefill(torch.tensor(ids[:40]), pool, table)
    bt = torch.tensor([table], dtype=torch.int32)
    for pos in range(40, 45):
        logits = lm.model.decode(torch.tensor([ids[pos]]), pool, bt, torch.tensor([pos]))
        assert (logits[0] - whole[pos]).abs().max().item() <= 1e-4


def test_batched_decode_of_ragged_sequences_equals_solo(lm):
    lengths = [3, 17, 31, 16, 40, 5, 64, 9]
    prompts = [_prompt(n, 10 + i, lm.config.vocab_size) for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine = Engine(lm, num_blocks=64)
    batch = engine.generate_batch(prompts, params)
    solo = [engine.generate(p, params) for p in prompts]
    assert batch == solo
    assert all(len(o) == 12 for o in batch)
    assert engine.pool.num_free == 64  # everything given back
    # The logits of one batched step equal each sequence's own step.
    pool = KVPool(lm.config, 64, 16)
    tables = [pool.allocate(pool.blocks_for(n + 1)) for n in lengths]
    for p, t in zip(prompts, tables):
        lm.model.prefill(torch.tensor(p[:-1]), pool, t)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    last = torch.tensor([p[-1] for p in prompts])
    pos = torch.tensor([n - 1 for n in lengths])
    batched = lm.model.decode(last, pool, bt, pos)
    for i in range(len(prompts)):
        one = lm.model.decode(last[i : i + 1], pool, bt[i : i + 1], pos[i : i + 1])
        assert (one[0] - batched[i]).abs().max().item() <= 1e-4


def _confident_agreement(tokens: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row: (token is the oracle's argmax, the oracle's top-2 margin exceeds ARGMAX_MARGIN)."""
    top2 = ref.topk(2, dim=-1).values
    return tokens == ref.argmax(-1), top2[:, 0] - top2[:, 1] > ARGMAX_MARGIN


def test_bf16_close_to_fp32(lm, oracle):
    bf = load_model("tiny-random", dtype=torch.bfloat16)
    assert bf.model.dtype == torch.bfloat16 and bf.weights_id == lm.weights_id
    assert bf.fingerprint != lm.fingerprint  # bf16 blocks never answer for fp32 ones
    ids = _prompt(64, 6, lm.config.vocab_size)
    a, _, _ = _prefill_all(lm, ids)
    with torch.inference_mode():
        ref = oracle(torch.tensor([ids])).logits[0]
    # Chunked prefill in bf16: every chunk reads its prefix back from the bf16 pool.
    pool = KVPool(bf.config, 8, 16, dtype=torch.bfloat16)
    table = pool.allocate(4)
    b = torch.cat(
        [
            bf.model.prefill(torch.tensor(ids[s : s + 8]), pool, table, start_pos=s)
            for s in range(0, 64, 8)
        ]
    )
    rel = (a - b).norm() / a.norm()
    assert rel < 0.05
    agree, confident = _confident_agreement(b.argmax(-1), ref)
    # The engine's bf16 greedy tokens, each checked against the oracle given the same prefix.
    out = Engine(bf, chunk_size=8).generate(ids[:30], SamplingParams(max_tokens=8, ignore_eos=True))
    assert len(out) == 8
    with torch.inference_mode():
        steps = oracle(torch.tensor([ids[:30] + out[:-1]])).logits[0, 29:]
    step_agree, step_confident = _confident_agreement(torch.tensor(out), steps)
    agree, confident = torch.cat([agree, step_agree]), torch.cat([confident, step_confident])
    assert confident.float().mean() >= 0.5, "too few positions clear the margin to test argmax"
    assert agree[confident].all(), f"argmax differs at {(~agree & confident).nonzero().tolist()}"


def test_kv_pool_allocation():
    lm = load_model("tiny-random")
    pool = KVPool(lm.config, 6, 4)
    c = lm.config
    assert pool.kv.shape == (6, c.num_layers, 2, 4, c.num_kv_heads, c.head_dim)
    assert pool.block_bytes == c.num_layers * 2 * 4 * c.num_kv_heads * c.head_dim * 4
    k, v = pool.layer_kv(1)
    assert k.shape == (6, 4, c.num_kv_heads, c.head_dim)
    k[2, 1] = 7.0  # views write through to the layer-major pool
    assert pool.kv[2, 1, 0, 1].eq(7.0).all() and pool.kv[2, 1, 1].eq(0).all()
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.num_free == 2
    with pytest.raises(PoolExhausted, match="3 blocks asked, 2"):
        pool.allocate(3)
    assert pool.num_free == 2  # a failed allocation takes nothing
    pool.free(a[:2])
    assert pool.num_free == 4
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(a[:1])
    assert isinstance(PoolExhausted("x"), MemoryError)


def test_sampling():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    greedy = sample(logits, [SamplingParams()] * 4)
    assert torch.equal(greedy, logits.argmax(-1))
    hot = SamplingParams(temperature=1.0, seed=7)
    a = sample(logits, [hot] * 4, [hot.generator() for _ in range(4)])
    b = sample(logits, [hot] * 4, [hot.generator() for _ in range(4)])
    assert torch.equal(a, b)  # same seed, same tokens
    draws = {
        int(
            sample(
                logits[:1],
                [SamplingParams(temperature=1.0, seed=s)],
                [SamplingParams(temperature=1.0, seed=s).generator()],
            )[0]
        )
        for s in range(40)
    }
    assert len(draws) > 1  # it does sample
    top3 = set(logits[0].topk(3).indices.tolist())
    for s in range(30):
        p = SamplingParams(temperature=2.0, top_k=3, seed=s)
        assert int(sample(logits[:1], [p], [p.generator()])[0]) in top3
    # top_p small keeps only the most likely token.
    p = SamplingParams(temperature=1.0, top_p=1e-6, seed=3)
    assert int(sample(logits[:1], [p], [p.generator()])[0]) == int(logits[0].argmax())
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-1), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_sampled_tokens_follow_the_tempered_distribution():
    # One row per seed in one batch (each row its own generator): the tokens' frequencies
    # match softmax(logits / T), a token of no mass (-inf) never comes, and a greedy row in the
    # same batch keeps its argmax.
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5]).repeat(4001, 1)
    params = [SamplingParams(temperature=0.5, seed=s) for s in range(4000)] + [SamplingParams()]
    out = sample(logits, params, [p.generator() for p in params])
    assert int(out[-1]) == 2
    counts = torch.bincount(out[:-1], minlength=5).double() / 4000
    want = (logits[0] / 0.5).softmax(-1).double()
    assert counts[3] == 0
    assert torch.allclose(counts, want, atol=0.025), (counts, want)


def test_engine_stops(lm):
    engine = Engine(lm)
    ids = _prompt(10, 8, lm.config.vocab_size)
    free_run = engine.generate(ids, SamplingParams(max_tokens=20, ignore_eos=True))
    stop_tok = free_run[5]
    first = free_run.index(stop_tok)
    out = engine.generate(
        ids, SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(stop_tok,))
    )
    assert out == free_run[: first + 1]
    # Sampled generation is reproducible per seed.
    p = SamplingParams(max_tokens=10, temperature=0.8, seed=5, ignore_eos=True)
    assert engine.generate(ids, p) == engine.generate(ids, p)


def test_bad_input(lm):
    engine = Engine(lm)
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="context window"):
        engine.generate([5] * lm.config.max_position_embeddings, SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([5, lm.config.vocab_size], SamplingParams())
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        load_model("nope")
    with pytest.raises(FileNotFoundError):
        load_model("/nonexistent/x.gguf")
    pool = KVPool(lm.config, 4, 16)
    with pytest.raises(ValueError, match="block table"):
        lm.model.prefill(torch.tensor([1] * 40), pool, pool.allocate(2))


def test_tokenizer(lm):
    tok = lm.tokenizer
    text = "Hello, wörld! 123 \n\t<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert 2 in ids  # the special token became its id
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat[0] == tok.token_to_id("<|im_start|>") and tok.decode(
        chat, skip_special_tokens=False
    ).endswith("assistant\n")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "x"}])


def test_prefill_batch_equals_prefill_per_sequence(lm):
    # (prompt length, cached prefix length): fresh, block-aligned prefix, prefix off a block
    # boundary, short fresh.
    shapes = [(40, 0), (41, 16), (30, 21), (7, 0)]
    prompts = [_prompt(n, 20 + i, lm.config.vocab_size) for i, (n, _) in enumerate(shapes)]
    pools = [KVPool(lm.config, 32, 16), KVPool(lm.config, 32, 16)]
    tables = [[pool.allocate(pool.blocks_for(n)) for n, _ in shapes] for pool in pools]
    for pool, pool_tables in zip(pools, tables):
        for ids, table, (_, start) in zip(prompts, pool_tables, shapes):
            if start:
                lm.model.prefill(torch.tensor(ids[:start]), pool, table)
    solo = [
        lm.model.prefill(
            torch.tensor(ids[start:]), pools[0], table, start_pos=start, last_only=True
        )
        for ids, table, (_, start) in zip(prompts, tables[0], shapes)
    ]
    seen = []
    seqs = [
        (torch.tensor(ids[start:]), table, start)
        for ids, table, (_, start) in zip(prompts, tables[1], shapes)
    ]
    batched = lm.model.prefill_batch(seqs, pools[1], on_layer_done=seen.append)
    assert seen == list(range(lm.config.num_layers))
    assert len(batched) == len(shapes)
    for one, many in zip(solo, batched):
        assert many.shape == (1, lm.config.vocab_size) and many.dtype == torch.float32
        assert (one - many).abs().max().item() <= 1e-4
    for table_a, table_b in zip(*tables):
        assert (pools[0].kv[table_a] - pools[1].kv[table_b]).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="block table"):
        lm.model.prefill_batch([(torch.tensor(prompts[0]), tables[1][0][:1], 0)], pools[1])
