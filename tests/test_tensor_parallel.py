"""Tensor parallelism on 8 host CPU devices: the same tokens as one device (model axis 2 and 4).

XLA_FLAGS must be set before jax is imported, so the check runs in a subprocess.
"""

import subprocess
import sys
import textwrap

from host_devices import env_with_devices

SCRIPT = textwrap.dedent(
    """
    import jax
    from flax import nnx
    import eagle_jax as ej
    import eagle_jax.sharding
    from eagle_jax.config import DrafterConfig, SpecConfig, TargetConfig
    from eagle_jax.sharding import make_mesh

    assert len(jax.devices()) == 8, jax.devices()
    c = TargetConfig(architecture="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=4,
                     num_heads=4, num_kv_heads=4, head_dim=16)
    t = ej.Target(c, rngs=nnx.Rngs(1))
    dc = DrafterConfig(hidden_size=64, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=96, vocab_size=64,
                       draft_vocab_size=32, target_hidden_size=64)
    d = ej.Drafter(dc, t.embed_tokens[...], rngs=nnx.Rngs(2))
    d.set_vocab_map([2 * i - i for i in range(32)])
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 12]
    # Sampled chain (acceptance draws from the same keys) and greedy tree, compile-bound.
    cases = ((SpecConfig(num_speculative_tokens=3), 1.0),
             (SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8), 0.0))
    # Model axis 2 for one case and 4 for the other: 4 programs, each layout's rules exercised.
    for (spec, temperature), m in zip(cases, (2, 4)):
        ref = ej.generate(t, d, prompts, max_new_tokens=12, spec=spec, temperature=temperature, seed=3)
        mesh = make_mesh(1, 1, m, jax.devices()[:m])
        r = ej.generate(t, d, prompts, max_new_tokens=12, spec=spec, temperature=temperature, seed=3, mesh=mesh)
        assert r.tokens == ref.tokens, (spec.method, temperature, m, r.tokens, ref.tokens)
        assert r.accepted == ref.accepted
    # Sharded weights really are sharded (not silently replicated).
    sharded = ej.sharding.shard_tree(nnx.state(t), make_mesh(1, 1, 4, jax.devices()[:4]))
    q = sharded["layers"][0]["self_attn"]["q_proj"]["kernel"][...]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model"), q.sharding
    print("TP-OK")
    """
)


def test_tensor_parallel_matches_single_device():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env_with_devices(8), timeout=900
    )
    assert proc.returncode == 0 and "TP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
