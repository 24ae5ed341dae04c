"""The tiny GRPO update problem shared by the sharded and multi-host update scripts."""

import numpy as np

import models


def update_problem():
    """``(config, arrays)``: a 2-layer Qwen2-shaped config and one minibatch of host arrays
    (``prompt``, ``prompt_mask`` ``[8, 6]``; ``response``, ``loss_mask``, ``logp_old``,
    ``logp_sparse`` ``[8, 10]``; ``adv`` ``[8]``), the same on every call and process."""
    config = models.ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32,
                                intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                head_dim=8, attention_bias=True)
    rng = np.random.default_rng(0)
    n, p, m = 8, 6, 10
    prompt = rng.integers(1, 64, (n, p)).astype(np.int32)
    prompt_mask = np.ones((n, p), np.int32)
    prompt_mask[:3, :2] = 0
    response = rng.integers(1, 64, (n, m)).astype(np.int32)
    loss_mask = (np.arange(m)[None] < rng.integers(3, m + 1, n)[:, None]).astype(np.int32)
    logp_old = -rng.uniform(0.5, 4.0, (n, m)).astype(np.float32)
    logp_sparse = logp_old + rng.normal(0, 0.3, (n, m)).astype(np.float32)
    adv = rng.normal(size=n).astype(np.float32)
    return config, dict(prompt=prompt, prompt_mask=prompt_mask, response=response,
                        loss_mask=loss_mask, logp_old=logp_old, logp_sparse=logp_sparse, adv=adv)


def sharded_update(config, batch, mesh):
    """One Adam update (lr 1e-2) of the ``config`` model, initialised from seed 0 straight into
    its shardings on ``mesh``, on ``batch`` (a ``Minibatch`` of arrays laid out for ``mesh``).
    Returns ``(new_params, metrics)``."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparse_rl_jax.rl.loss_config import GRPOLossConfig
    from sparse_rl_jax.rl.optim import OptimConfig, make_optimizer
    from sparse_rl_jax.training.rl_step import batch_sharding
    from sparse_rl_jax.rl.update_step import init_optimizer, jit_update_step

    def build():
        return models.Decoder(config, dtype=jnp.float32, param_dtype=jnp.float32,
                              rngs=nnx.Rngs(0))

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = models.param_shardings(abstract, mesh)
    params = jax.jit(lambda: nnx.split(build())[1], out_shardings=shardings)()
    optimizer = make_optimizer(OptimConfig(lr=1e-2, weight_decay=0.1))
    opt_state, opt_shardings = init_optimizer(optimizer, params, mesh)
    step = jit_update_step(graphdef, loss_cfg=GRPOLossConfig(), optimizer=optimizer,
                           param_shardings=shardings, opt_shardings=opt_shardings,
                           batch_sharding=batch_sharding(mesh), chunk_size=4)
    new_params, _, metrics = step(params, opt_state, batch)
    return new_params, metrics
