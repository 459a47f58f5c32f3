"""A DeepSeek-V3-style target (MLA + MoE) sharded over 8 host CPU devices gives the tokens, accepted
drafts and logits of one device: experts over the "expert" mesh axis, heads and expert hidden units
over "model". The pair is engine_models' near-bigram one with an MLA drafter (whose latent cache is
laid out by the same rules as the target's), so tree rounds accept several drafts. TTT training
of an MLA drafter against that target on a data x expert x model mesh follows the loss curve of a
data-parallel run (8 shards of the batch: the same sums in another order; 2e-5 relative, as
tests/test_training.py allows for sharded runs).

XLA_FLAGS must be set before jax is imported, so the checks run in subprocesses.
"""

import os
import subprocess
import sys
import textwrap

from host_devices import env_with_devices

SCRIPT = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    import eagle_jax as ej
    from eagle_jax.config import SpecConfig
    from eagle_jax.sharding import make_mesh, shard_tree
    from engine_models import deepseek_config, markov_mla_drafter, markov_target

    assert len(jax.devices()) == 8, jax.devices()
    t, succ = markov_target(vocab=32, hidden=64, seed=1, eps=0.1, config=deepseek_config(32, 64))
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [3] * 12]
    spec = SpecConfig(method="tree", tree_top_k=3, tree_depth=3, tree_total_tokens=8)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 32, (2, 16)), jnp.int32)
    graph, state = nnx.split(t)
    forward = jax.jit(lambda s, x: nnx.merge(graph, s)(x, (0, 1, 2)))
    ref_logits, ref_aux = forward(state, ids)
    # Tensor parallelism alone (the "model" axis) is covered by test_tensor_parallel.py.
    meshes = {"expert4 x model2": make_mesh(1, 1, 2, expert=4), "expert8": make_mesh(expert=8)}
    for name, mesh in meshes.items():
        sharded = shard_tree(state, mesh)
        logits, aux = forward(sharded, ids)
        for got, want in ((logits, ref_logits), (aux, ref_aux)):
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            assert err <= 1e-5, (name, err)
        kernel = sharded["layers"][1]["mlp"]["experts"]["gate_proj"]["kernel"][...]
        want_spec = {"expert4 x model2": P("expert", None, "model"), "expert8": P("expert", None, None)}[name]
        assert kernel.sharding.spec == want_spec, (name, kernel.sharding)
        print(name, "max rel err", err)
    mla, _ = markov_mla_drafter(t, succ, seed=1, disagree=0.25)
    ref = ej.generate(t, mla, prompts, max_new_tokens=10, spec=spec, eos_token_id=[])
    # The whole loop on both axes at once (compiling it is most of this test).
    r = ej.generate(t, mla, prompts, max_new_tokens=10, spec=spec, eos_token_id=[], mesh=meshes["expert4 x model2"])
    assert (r.tokens, r.accepted) == (ref.tokens, ref.accepted), "MLA drafter"
    assert max(a for row in ref.accepted for a in row) >= 2, ref.accepted
    print("EP-OK")
    """
)

TRAIN_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np
    from eagle_jax.training.trainer import load_config, train

    losses = {}
    for mesh in ("{data: 8}", "{data: 2, fsdp: 1, expert: 2, model: 2}"):
        cfg = load_config(sys.argv[1], ["train.steps=60", "train.ttt_length=3", "data.max_length=32",
                                        "checkpoint.every=0", "data.synthetic={num_samples: 64, prompt_length: 8}",
                                        "log.every=1", "log.progress=false", "mesh=" + mesh,
                                        "run_dir=" + sys.argv[2] + str(len(losses))])
        losses[mesh] = np.array([r["loss"] for r in train(cfg, stop_after=4)["records"]])
    a, b = losses.values()
    np.testing.assert_allclose(b, a, rtol=2e-5)
    print("EP-TRAIN-OK", a, b)
    """
)


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    here = os.path.dirname(os.path.abspath(__file__))  # engine_models
    env = env_with_devices(8, here, os.path.dirname(here))
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=900)


def test_expert_parallel_matches_single_device():
    proc = _run(SCRIPT)
    assert proc.returncode == 0 and "EP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_training_on_an_expert_mesh(tmp_path):
    recipe = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "train", "tiny_mla_moe.yaml"
    )
    proc = _run(TRAIN_SCRIPT, recipe, str(tmp_path / "run"))
    assert proc.returncode == 0 and "EP-TRAIN-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh {'data': 2, 'fsdp': 1, 'expert': 2, 'model': 2}" in proc.stdout
