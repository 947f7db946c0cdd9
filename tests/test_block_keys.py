"""Block keys: the chained prefix hash of DESIGN.md (kvstore.block_keys)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import KEY_BYTES, block_keys

tokens_st = st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=80)
bs_st = st.integers(1, 17)


@settings(max_examples=60, deadline=None)
@given(tokens_st, tokens_st, bs_st)
def test_equal_prefixes_give_equal_keys(prefix, tail, bs):
    a = block_keys(prefix + tail, bs, "fp")
    b = block_keys(prefix, bs, "fp")
    assert a[: len(b)] == b
    assert all(len(k) == KEY_BYTES for k in a)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 1000), min_size=1, max_size=80), bs_st, st.data())
def test_one_changed_token_changes_its_block_and_every_later_one(tokens, bs, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] += 1
    a, b = block_keys(tokens, bs, "fp"), block_keys(changed, bs, "fp")
    block = i // bs
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:]))


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.integers(0, 1000), min_size=4, max_size=64),
    st.text(max_size=8),
    st.text(max_size=8),
)
def test_salt_and_fingerprint_separate_keys(tokens, s1, s2):
    if s1 == s2:
        return
    a, b = block_keys(tokens, 4, "fp", salt=s1), block_keys(tokens, 4, "fp", salt=s2)
    assert all(x != y for x, y in zip(a, b))
    assert block_keys(tokens, 4, "fp-a") != block_keys(tokens, 4, "fp-b")


@settings(max_examples=60, deadline=None)
@given(tokens_st, bs_st)
def test_only_full_blocks_get_keys_and_chains_continue(tokens, bs):
    keys = block_keys(tokens, bs, "fp")
    assert len(keys) == len(tokens) // bs
    if len(keys) >= 2:
        cut = bs  # continuing from the first key gives the rest of the chain
        assert block_keys(tokens[cut:], bs, "fp", parent=keys[0]) == keys[1:]


def test_keys_are_distinct_along_a_chain_and_reject_bad_block_size():
    keys = block_keys([7] * 64, 16, "fp")  # identical blocks still get different keys (they chain)
    assert len(set(keys)) == 4
    # Fingerprint and salt are length-prefixed: ("ab", "c") and ("a", "bc") do not collide.
    assert block_keys([1] * 4, 4, "ab", salt="c") != block_keys([1] * 4, 4, "a", salt="bc")
    with pytest.raises(ValueError):
        block_keys([1, 2], 0, "fp")
