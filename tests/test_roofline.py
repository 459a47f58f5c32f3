"""bench/roofline.py's counting model against hand-computed numbers, and bench.speed's roofline row builder."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the bench package

from engine_models import deepseek_config, drafter_config

import eagle_jax
from bench import roofline as rl
from eagle_jax import Drafter, SpecConfig, Target, TargetConfig
from eagle_jax.modeling.flops import matmul_params

# vocab 64, hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 kv heads; untied lm_head.
TINY = TargetConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=256,
)
ATTN = 32 * 32 + 2 * 32 * 16 + 32 * 32  # q, k, v, o = 3072
MLP = 3 * 32 * 64  # 6144
LM_HEAD = 64 * 32
PER_TOKEN = 2 * (ATTN + MLP) + LM_HEAD  # 20480
KV = 2 * 2 * 2 * 8  # numbers per token: layers x (k, v) x kv_heads x head_dim = 64
PAIR = 4 * 4 * 8  # scores + values, 4 heads of 8: 128 FLOPs per (query, key) and layer


def test_params_by_hand():
    p = rl.target_params(TINY)
    assert p.per_token == PER_TOKEN == p.total
    assert rl.kv_numbers_per_token(TINY, TINY.num_layers) == KV
    assert rl.attention_flops_per_pair(TINY, True) == PAIR


def test_plain_decode_step_by_hand():
    # batch 1, 10 cached tokens: the new token attends over 11 keys in each of 2 layers.
    c = rl.target_forward(TINY, 1, 1, 10, weight_bytes=4, cache_bytes=4)
    assert c.flops == 2 * PER_TOKEN + 11 * 2 * PAIR == 43776
    assert c.weight_bytes == (PER_TOKEN + 32) * 4  # every weight once + the embedding row
    assert c.kv_read_bytes == 10 * KV * 4 and c.kv_write_bytes == KV * 4
    assert c.bytes == 82048 + 2560 + 256
    # batch 3: weights read once, FLOPs and KV traffic x 3
    c3 = rl.target_forward(TINY, 3, 1, 10, weight_bytes=2, cache_bytes=2)
    assert c3.flops == 3 * c.flops
    assert c3.weight_bytes == (PER_TOKEN + 3 * 32) * 2
    assert c3.kv_read_bytes == 3 * 10 * KV * 2
    # as a decode_round with no speculation
    assert rl.decode_round(TINY, None, None, 1, 10, weight_bytes=4, cache_bytes=4) == c


def test_verify_width_and_prefill_by_hand():
    # K=3 verification: 4 positions, each attending 10 + (1..4) keys; lm_head on all 4.
    v = rl.target_forward(TINY, 1, 4, 10, weight_bytes=4, cache_bytes=4)
    assert v.flops == 4 * 2 * PER_TOKEN + (11 + 12 + 13 + 14) * 2 * PAIR
    assert v.weight_bytes == (PER_TOKEN + 4 * 32) * 4  # the weights once for the whole block
    # prefill of 16: causal pairs 16*17/2, lm_head at the last position only
    p = rl.target_prefill(TINY, 2, 16, weight_bytes=4, cache_bytes=4)
    assert p.flops == 2 * (16 * 2 * 2 * (ATTN + MLP) + 2 * LM_HEAD + 136 * 2 * PAIR)
    assert p.kv_read_bytes == 0 and p.kv_write_bytes == 2 * 16 * KV * 4
    # the drafter's prefill: fc and the key/value projections on every position, the rest of its layer, its attention
    # over the prompt and its lm_head at the last position only
    dc = drafter_config(TINY, draft_vocab=32)
    dp, kv = rl.drafter_params(dc), 2 * 64 * 16  # 2H = 64 inputs to 2 kv heads x 8 wide, keys and values
    q = rl.drafter_prefill(dc, 2, 16, weight_bytes=4, cache_bytes=4)
    assert q.flops == 2 * 2 * 16 * (dp.fc + kv) + 2 * 2 * (
        dp.layer - kv + dp.lm_head
    ) + 2 * 16 * rl.attention_flops_per_pair(dc, False)


def test_chain_and_tree_rounds_are_their_parts():
    dc = drafter_config(TINY, draft_vocab=32)
    kw = dict(weight_bytes=4, cache_bytes=4)
    dp = rl.drafter_params(dc)
    assert dp.fc == dc.num_aux_hidden_states * 32 * 32 and dp.lm_head == 32 * 32
    assert dp.layer == (64 * 32 + 2 * 64 * 16 + 32 * 32) + 3 * 32 * 64  # attention over the 2H input + MLP
    k = 3
    chain = rl.decode_round(TINY, dc, SpecConfig(num_speculative_tokens=k), 2, 20, **kw)
    parts = rl.target_forward(TINY, 2, k + 1, 20, **kw) + rl.drafter_forward(
        dc, 2, k + 1, 20, fuse=True, logit_positions=1, **kw
    )
    for i in range(k - 1):
        parts = parts + rl.drafter_forward(dc, 2, 1, 20 + i, logit_positions=1, **kw)
    assert chain == parts
    tree = rl.decode_round(
        TINY, dc, SpecConfig(method="tree", tree_top_k=2, tree_depth=3, tree_total_tokens=6), 1, 20, **kw
    )
    assert tree.flops > rl.target_forward(TINY, 1, 6, 20, **kw).flops
    # per generated token: 10 rounds that emitted 25 tokens
    per = rl.per_generated_token(TINY, dc, SpecConfig(num_speculative_tokens=k), 2, 20, 50, rounds=10, **kw)
    round_at = rl.decode_round(TINY, dc, SpecConfig(num_speculative_tokens=k), 2, 20 + 1 + 50 / 2 / 2, **kw)
    assert per.flops == pytest.approx(round_at.flops * 10 / 50)
    # without rounds: tokens / (batch x AL)
    per_al = rl.per_generated_token(
        TINY, dc, SpecConfig(num_speculative_tokens=k), 2, 20, 50, acceptance_length=2.5, **kw
    )
    assert per_al.flops == pytest.approx(per.flops)


def test_counts_match_the_trainer_and_moe_counts_active_experts():
    tc = deepseek_config(32)
    target = nnx.eval_shape(lambda: Target(tc, rngs=nnx.Rngs(0)))  # shapes only: nothing initialised
    drafter = nnx.eval_shape(lambda: Drafter(drafter_config(tc), rngs=nnx.Rngs(1)))
    p = rl.target_params(tc)
    assert p.per_token == pytest.approx(
        matmul_params(target) + (tc.vocab_size * tc.hidden_size if tc.tie_word_embeddings else 0)
    )
    assert p.per_token < p.total  # 2 of 8 routed experts
    d = rl.drafter_params(drafter.config)
    assert d.fc + d.layer + d.lm_head == matmul_params(drafter)
    tiny = nnx.eval_shape(lambda: Target(TINY, rngs=nnx.Rngs(0)))
    assert rl.target_params(TINY).per_token == matmul_params(tiny)
    # MLA latent cache: kv_lora_rank + rope per token and layer; one token touches 2 experts, many touch all 8
    assert rl.kv_numbers_per_token(tc, tc.num_layers) == tc.num_layers * (32 + 8)
    assert p.touched_experts(1) == pytest.approx(2)
    assert p.touched_experts(1000) == pytest.approx(8)


def test_roofline_columns():
    peaks = {"matmul_flops": 1e9, "read_bytes_per_s": 1e8}
    cost = rl.Cost(flops=2e6, weight_bytes=1e6)
    r = rl.roofline(cost, 100.0, peaks)
    assert r["achieved_flops"] == 2e8 and r["flops_fraction"] == pytest.approx(0.2)
    assert r["achieved_bytes_per_s"] == 1e8 and r["bytes_fraction"] == pytest.approx(1.0)
    assert r["bound"] == "memory" and r["roofline_fraction"] == pytest.approx(
        1.0
    )  # 10 ms at peak bytes, 10 ms per token
    assert len(rl.roofline_cells(r)) == len(rl.ROOFLINE_HEADER)
    peaks_small = rl.measure_peaks(matmul_n=128, read_mb=4)
    assert peaks_small["matmul_flops"] > 0 and peaks_small["read_bytes_per_s"] > 0


def test_speed_row_builder_on_tiny_models():
    from bench.speed import prefill_row, roofline_row

    target = Target(TINY, rngs=nnx.Rngs(0))
    drafter = Drafter(drafter_config(TINY), embed=target.embed_tokens[...], rngs=nnx.Rngs(1))
    prompts = [[1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 8, 9]]
    spec = SpecConfig(num_speculative_tokens=2)
    peaks = {"matmul_flops": 1e10, "read_bytes_per_s": 1e10}
    r = eagle_jax.generate(target, drafter, prompts, max_new_tokens=6, spec=spec, eos_token_id=[])
    pre = 0.25 * r.run_s  # bench.speed times it with time_prefill (another compile: not here)
    row = roofline_row(target, drafter, spec, r, prompts, pre, peaks)
    for key in (
        "decode_tokens_per_s",
        "flops_per_token",
        "bytes_per_token",
        "achieved_flops",
        "achieved_bytes_per_s",
        "flops_fraction",
        "bytes_fraction",
        "time_at_peak_flops",
        "time_at_peak_bytes",
        "bound",
        "roofline_fraction",
    ):
        assert key in row
    expected = rl.per_generated_token(
        TINY, drafter.config, spec, 2, 7, r.num_generated - 2, r.rounds, weight_bytes=4, cache_bytes=4
    )
    assert row["flops_per_token"] == pytest.approx(expected.flops)
    assert row["decode_tokens_per_s"] == pytest.approx((r.num_generated - 2) / (r.run_s - pre))
    p = prefill_row(target, drafter, prompts, pre, peaks)
    assert p["flops_per_token"] == pytest.approx(
        rl.prefill(TINY, drafter.config, 2, 16, weight_bytes=4, cache_bytes=4).flops / 32
    )
    assert math.isfinite(p["prefill_tokens_per_s"])
