"""Energy attention on a GPU or TPU: the Pallas kernels against `jax.nn.dot_product_attention`.

Question: on an accelerator, what do the energy attention's passes (each a Pallas kernel
there) cost against the fused attention JAX offers, and what memory do they hold?

Contenders, per shape (batch 1, 8 heads, keys as long as the queries):

- `energy_value`: the Hopfield energy's value (the forward kernel: log-sum-exp only);
- `energy_output`: the attention output, the energy's gradient in the queries, `softmax(beta q
  k^T) k` (forward + one terms pass);
- `energy_value_and_grad`: value and gradient in queries and keys;
- `energy_jvp`: the JVP of the attention output in the queries (forward mode);
- `energy_hvp`: forward-over-reverse Hessian-vector product of the energy;
- `dpa_xla`, `dpa_cudnn`: `jax.nn.dot_product_attention(q, k, k)` by XLA and by cuDNN
  (GPU only, half precision), and `dpa_cudnn_train`: its value and gradient (the training
  step's baseline); `pallas_mha`: JAX's own Pallas GPU attention (`mha`, GPU only).
- `et_train`, `ebt_train`: one training gradient of an Energy Transformer (8 heads, two
  descent steps: attention derivatives of second order) and of an energy-based
  transformer (thinking two steps, trained through them), on the same tokens, reported at
  the attention's flop count (their own rates are lower).

Units: TFLOP/s counted as 4 B H N^2 d for one attention (halved for causal), the way JAX's
Pallas benchmarks count, whatever pass is timed (so the rate of a JVP is that of the
attention it differentiates); peak memory is XLA's temporary-buffer accounting of each
compiled program. Times are medians of interleaved repeats after an untimed call.

Targets (on an H100): bfloat16 `energy_output` >= 0.8 x `dpa_cudnn` at head dim
128 and seq >= 4k; `energy_jvp` <= 2 x `energy_output`; `et_train` and `ebt_train` <= 1.3 x
`dpa_cudnn_train`; memory O(seq) in every mode.

    python benchmarks/accelerator.py [--quick]
"""

import argparse
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.random as jr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import interleaved, print_row, write_rows  # noqa: E402

import energyattn as ea  # noqa: E402

HEADS = 8
#: The longest sequence measured (the energy-based transformer's learned positions).
MAX_SEQ = 16384


def contenders(head_dim: int, causal: bool, dtype, platform: str) -> dict:
    beta = head_dim**-0.5

    def energy(q, k):
        def one_head(q, k):
            lse = ea.attention_logsumexp(q, k, beta=beta, causal=causal)
            return -jnp.sum(lse) / beta

        return jnp.sum(jax.vmap(one_head, in_axes=1)(q, k))

    def output(q, k):  # softmax(beta q k^T) k, as the energy's gradient
        return -jax.grad(energy)(q, k)

    def dpa(implementation):
        def run(q, k):
            return jax.nn.dot_product_attention(
                q[None], k[None], k[None], scale=beta, is_causal=causal,
                implementation=implementation,
            )  # fmt: skip

        return run

    fns = {
        "energy_value": energy,
        "energy_output": output,
        "energy_value_and_grad": jax.value_and_grad(energy, argnums=(0, 1)),
        "energy_jvp": lambda q, k: jax.jvp(lambda q: output(q, k), (q,), (q,)),
        "energy_hvp": lambda q, k: jax.jvp(lambda q: jax.grad(energy)(q, k), (q,), (q,))[1],
        "dpa_xla": dpa("xla"),
    }
    if platform == "gpu" and jnp.dtype(dtype).itemsize == 2 and head_dim <= 128:
        fns["dpa_cudnn"] = dpa("cudnn")
        fns["dpa_cudnn_train"] = jax.value_and_grad(
            lambda q, k: jnp.sum(dpa("cudnn")(q, k).astype(jnp.float32)), argnums=(0, 1)
        )
    if platform == "gpu":
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

        def mha(q, k):
            return pallas_attention.mha(
                q[None], k[None], k[None], None, sm_scale=beta, causal=causal
            )

        fns["pallas_mha"] = mha
    return fns


def model_steps(head_dim: int, dtype) -> tuple[dict, dict]:
    """One training gradient of an Energy Transformer and of an energy-based transformer on
    `(seq, heads, head_dim)` tokens, flattened to `(seq, heads * head_dim)`: the functions
    `(q, k, model)` and the models (arguments of the compiled programs, not constants)."""
    dim = HEADS * head_dim
    key = jr.key(0)
    et = ea.nn.EnergyTransformer(
        dim, num_heads=HEADS, head_dim=head_dim, num_memories=dim, num_steps=2, key=key
    )
    et = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, et)

    def et_loss(model, x):
        return jnp.mean(jnp.square(model(x).astype(jnp.float32) - x.astype(jnp.float32)))

    et_params, et_static = eqx.partition(et, eqx.is_array)

    def et_train(q, k, params):
        x = q.reshape(q.shape[0], -1)
        return eqx.filter_grad(et_loss)(eqx.combine(params, et_static), x)

    ebt = ea.models.EnergyBasedTransformer(dim, MAX_SEQ, dim, num_heads=HEADS, depth=1, key=key)

    ebt_params, ebt_static = eqx.partition(ebt, eqx.is_array)

    def ebt_train(q, k, params):
        x = q.reshape(q.shape[0], -1).astype(jnp.float32)

        def loss(model):
            context = model.context(x)
            y = jnp.zeros_like(x)
            for _ in range(2):  # two thinking steps, trained through
                y = y - model.step_size * jax.grad(context)(y)
            return jnp.mean(jnp.square(y - k.reshape(y.shape).astype(jnp.float32)))

        return eqx.filter_grad(loss)(eqx.combine(params, ebt_static))

    steps = {"et_train": et_train, "ebt_train": ebt_train}
    return steps, {"et_train": et_params, "ebt_train": ebt_params}


def peak_mib(fn, *args) -> float | None:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if analysis is None else analysis.temp_size_in_bytes / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run on a CPU anyway (with --quick: a check of the script, minutes, no kernel timed)",
    )
    args = parser.parse_args(argv)
    platform = jax.devices()[0].platform
    if platform == "cpu" and not (args.cpu and args.quick):
        raise SystemExit(
            "accelerator.py times the kernels on a GPU or TPU, and JAX sees only a CPU here. "
            "To check the script on a CPU (minutes; the XLA loop is timed, not the kernels), "
            "pass --quick --cpu."
        )
    seqs = (256, 512) if args.quick else (1024, 2048, 4096, 8192, 16384)
    dims = (64,) if args.quick else (64, 128)
    dtypes = (jnp.bfloat16,) if args.quick else (jnp.bfloat16, jnp.float32)
    repeats = 3 if args.quick else 10
    rows = []
    for dtype in dtypes:
        for head_dim in dims:
            for causal in (False, True):
                for seq in seqs:
                    kq, kk = jr.split(jr.key(seq))
                    q = jr.normal(kq, (seq, HEADS, head_dim), dtype)
                    k = jr.normal(kk, (seq, HEADS, head_dim), dtype)
                    fns = contenders(head_dim, causal, dtype, platform)
                    extra = {}
                    if not causal:  # the models' masks are their own: once per shape
                        steps, models = model_steps(head_dim, dtype)
                        fns.update(steps)
                        extra = {name: (q, k, model) for name, model in models.items()}
                    times = interleaved(fns, q, k, repeats=repeats, warm=True, args_for=extra)
                    flops = 4 * HEADS * seq**2 * head_dim / (2 if causal else 1)
                    for name, timing in times.items():
                        row = {
                            "contender": name,
                            "dtype": jnp.dtype(dtype).name,
                            "head_dim": head_dim,
                            "causal": causal,
                            "seq": seq,
                            "median_ms": 1e3 * timing["median_s"],
                            "tflops": flops / timing["median_s"] / 1e12,
                            "temp_mib": peak_mib(fns[name], *extra.get(name, (q, k))),
                        }
                        print_row(row)
                        rows.append(row)
    path = write_rows("accelerator_quick" if args.quick else f"accelerator_{platform}", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
