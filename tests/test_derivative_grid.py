"""One answer on every path: the attention log-sum-exp's implementations (naive, blockwise,
cuDNN's wiring, the ring on 2, 4 and 8 devices) give the same values and derivatives under
every transformation, to fourth order, for energies, layers and implicit solves built on it.

Optimistix-style: a grid of paths x transformations x surfaces. Each test is one surface;
for each path it compiles one program computing every transformation and compares it with
the naive path (plain autodiff of the `(seq, mem)` scores). Shapes are tiny and the
implementation is forced.
"""

import functools

import equinox as eqx
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import pytest

import energyattn as ea
from energyattn._dtypes import accumulation_dtype
from energyattn._energy import _attention
from energyattn._energy._attention import _cudnn

SEQ, DIM = 8, 3
TOL = {"float64": 1e-12, "float32": 1e-5, "implicit": 1e-10}


def mesh_of(num_devices):
    auto = (jax.sharding.AxisType.Auto,)
    return jax.make_mesh((num_devices,), ("seq",), auto, devices=jax.devices()[:num_devices])


def lse_path(path, block_size=3):
    """The log-sum-exp rows by one path: `(q, k, beta, mask, exclude_self, causal=False) ->
    (seq,)`."""

    def rows(q, k, beta, mask, exclude_self, causal=False):
        beta = jnp.asarray(beta, accumulation_dtype(q))
        ring = (mesh_of(int(path[4:])), "seq") if path.startswith("ring") else None
        method = {"fused": "cudnn", "naive": "naive", "pallas": "pallas"}.get(path, "blockwise")
        blocks = _attention.as_block_sizes(block_size)
        args = (q, k, beta, mask, exclude_self, method, blocks, ring)
        return _attention.lse_rows(*args, causal=causal)

    return rows


FIRST = ("value", "grad", "jvp", "linearize", "vmap")
SECOND = ("hvp_forward_over_reverse", "hvp_reverse_over_reverse", "jacfwd", "jacrev", "hessian")
EVERY = FIRST + SECOND + ("third", "fourth")
#: Gradients through programs that JAX partially evaluates as jaxprs: a checkpoint (saving
#: nothing, or the products), a `custom_jvp` (whose rule is a JVP of the energy) in a `jit`,
#: and the gradient of a JVP traced unnested (the fused pass, its log-sum-exp's tangent a
#: term) in a `jit`.
STAGED = ("checkpoint", "checkpoint_saving_dots", "custom_jvp_in_jit", "reverse_over_jitted_jvp")


def transformations(f, x, theta, tx, ttheta, names):
    """The transformations `names` of a scalar `f(x, theta)`, as a dict."""
    grad_x = jax.grad(f)

    def hvp_fr(x):  # forward over reverse
        return jax.jvp(lambda x: grad_x(x, theta), (x,), (tx,))[1]

    def third(x):
        return jax.grad(lambda x: jnp.vdot(hvp_fr(x), tx))(x)

    def directional(x, theta):  # forward mode, traced before it is differentiated
        return jax.jvp(f, (x, theta), (tx, ttheta))[1]

    dots = jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    staged = jax.custom_jvp(f)
    staged.defjvp(lambda primals, tangents: jax.jvp(f, primals, tangents))
    every = {
        "value": lambda: f(x, theta),
        "grad": lambda: jax.grad(f, argnums=(0, 1))(x, theta),
        "jvp": lambda: jax.jvp(f, (x, theta), (tx, ttheta)),
        "linearize": lambda: jax.linearize(f, x, theta)[1](tx, ttheta),
        "vmap": lambda: jax.vmap(grad_x, (0, None))(jnp.stack([x, -0.5 * x]), theta),
        "hvp_forward_over_reverse": lambda: hvp_fr(x),
        "hvp_reverse_over_reverse": lambda: jax.grad(lambda x: jnp.vdot(grad_x(x, theta), tx))(x),
        "jacfwd": lambda: jax.jacfwd(f, argnums=(0, 1))(x, theta),
        "jacrev": lambda: jax.jacrev(f, argnums=(0, 1))(x, theta),
        "hessian": lambda: jax.hessian(f)(x, theta),
        "third": lambda: third(x),  # reverse over forward over reverse
        "fourth": lambda: jax.jvp(third, (x,), (tx,))[1],
        "checkpoint": lambda: jax.grad(jax.checkpoint(f), argnums=(0, 1))(x, theta),
        "checkpoint_saving_dots": lambda: jax.grad(jax.checkpoint(f, policy=dots), argnums=(0, 1))(
            x, theta
        ),
        "custom_jvp_in_jit": lambda: jax.grad(jax.jit(staged), argnums=(0, 1))(x, theta),
        "reverse_over_jitted_jvp": lambda: jax.grad(jax.jit(directional), argnums=(0, 1))(x, theta),
    }
    return {name: every[name]() for name in names}


def up_to(order):
    """The transformations up to derivatives of `order` (1: the first-order ones and the
    Hessian-vector products; 2: everything of the grid; 3 and 4 add third and fourth
    derivatives)."""
    cut = {1: len(FIRST) + 2, 2: len(FIRST + SECOND), 3: len(EVERY) - 1, 4: len(EVERY)}
    return EVERY[: cut[order]]


def run_grid(surface, cells, dtype):
    """Compare every `(path, names)` cell's transformations with the naive path's."""
    expected = jax.device_get(surface("naive", max((n for _, n in cells), key=len)))
    for path, names in cells:
        got = jax.device_get(surface(path, names))
        for name, value in got.items():
            assert_same(value, expected[name], TOL[dtype], f"{path}, {name}")


def assert_same(result, reference, tol, where):
    pairs = zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True)
    for have, want in pairs:
        want, have = np.asarray(want), np.asarray(have)
        assert have.shape == want.shape, where
        scale = max(1.0, float(np.max(np.abs(want), initial=0)))
        error = float(np.max(np.abs(have - want), initial=0))
        assert error <= tol * scale, f"{where}: {error:.2e} (scale {scale:.2e})"


def data(dtype):
    rng = np.random.default_rng(0)
    arrays = [jnp.asarray(rng.normal(size=(SEQ, DIM)), dtype) for _ in range(4)]
    # Causal and padding at once (the last two memories are padding), and a query that may
    # attend to nothing (its log-sum-exp is 0 and it feels no force, on every path).
    mask = np.tril(np.ones((SEQ, SEQ), bool))
    mask[:, -2:] = False
    mask[0] = False
    return arrays, jnp.asarray(mask)


# ---------------------------------------------------------------------------------- energies


def hopfield_energy(rows, mask):
    def energy(q, k):
        lse = rows(q, k, 0.7, mask, False)
        return 0.5 * jnp.sum(q * q) - jnp.sum(lse) / 0.7 + jnp.sum(jnp.sin(lse))

    return energy, (SEQ, DIM)


def self_attention_energy(rows, mask):
    # The Energy Transformer's form: queries and keys from one state, the diagonal excluded,
    # two heads under vmap (head by head on a CPU).
    def energy(x, w):
        q, k = jnp.einsum("sd,hed->hse", x, w[:2]), jnp.einsum("sd,hed->hse", x, w[2:])
        lse = jax.vmap(lambda q, k: rows(q, k, 0.9, mask, True))(q, k)
        return -jnp.sum(lse) / 0.9 + 0.1 * jnp.sum(jnp.cos(lse))

    return energy, (4, DIM, DIM)


#: surface -> (energy, masked, dtype, [(path, order)]); `STAGED` too where the order is
#: written `(order, STAGED)`. `masked="causal"`: the mask's triangle
#: is given as `causal=True` (computed per block from the positions) on every path but the
#: naive reference, which holds it in its explicit mask. Fourth order in float64 on one device,
#: third on the ring of 2; the ring on 4 and 8 devices runs the same code as on 2, and float32
#: goes to second order (rounding, not the path, limits it). cuDNN's wiring runs through
#: XLA's kernel, which computes in float32 whatever the inputs, and takes no mask. "pallas":
#: the GPU kernels in Pallas's interpret mode (every mask, the heads in the grid by vmap).
ENERGIES = {
    "hopfield": (hopfield_energy, False, "float64", [("blockwise", 2), ("ring2", 2), ("ring8", 1)]),
    "hopfield_masked": (
        hopfield_energy,
        True,
        "float64",
        [("blockwise", (4, STAGED)), ("ring2", 3), ("ring4", 1), ("pallas", 3)],
    ),
    "self_attention": (
        self_attention_energy,
        "causal",
        "float64",
        [("blockwise", (3, STAGED)), ("ring2", 1), ("pallas", (2, STAGED))],
    ),
    "hopfield_float32": (
        hopfield_energy,
        False,
        "float32",
        [("blockwise", 2), ("fused", 2), ("pallas", 2)],
    ),
    "hopfield_masked_float32": (hopfield_energy, True, "float32", [("ring2", 2)]),
    # Segment ids (a query with nothing to attend to among them): the reference is the
    # naive path on their dense matrix.
    "hopfield_segments": (
        hopfield_energy,
        "segments",
        "float64",
        [("blockwise", 2), ("ring2", 1), ("pallas", 2)],
    ),
}


@pytest.mark.parametrize("name", list(ENERGIES))
def test_energies_every_path_every_transformation(name, monkeypatch):
    build, masked, dtype, cells = ENERGIES[name]
    # cuDNN needs a GPU; the same wiring (layouts, dtypes, the plain terms through the
    # fused kernel and its backward) runs here through XLA's kernel.
    monkeypatch.setattr(_cudnn, "FUSED_KERNEL", "xla")
    (x, _, tx, _), mask = data(dtype)
    rng = np.random.default_rng(1)

    def surface(path, names):
        rows, path_mask = lse_path(path), mask if masked else None
        if masked == "segments":
            ids = jnp.asarray([0, 1, 0, 1, 1, 0, 2, 0])
            path_mask = ea.SegmentIds(ids.at[6].set(3), ids)  # query 6: no key of its id
            path_mask = path_mask.dense() if path == "naive" else path_mask
        if masked == "causal" and path != "naive":
            # The rest of the mask (padding, the empty row) stays explicit, and allows
            # everything above the diagonal: the structure must take it out.
            rows = functools.partial(rows, causal=True)
            path_mask = mask | ~np.tril(np.ones(mask.shape, bool))
        f, theta_shape = build(rows, path_mask)
        theta = jnp.asarray(rng.normal(size=theta_shape) / DIM, dtype)
        ttheta = jnp.asarray(rng.normal(size=theta_shape), dtype)
        return jax.jit(transformations, static_argnums=(0, 5))(f, x, theta, tx, ttheta, names)

    rng_state = rng.bit_generator.state

    def same_draws(path, names):  # every path sees the same theta and direction
        rng.bit_generator.state = rng_state
        return surface(path, names)

    def names(order):
        return up_to(order) if isinstance(order, int) else up_to(order[0]) + order[1]

    run_grid(same_draws, [(path, names(order)) for path, order in cells], dtype)


# ------------------------------------------------------------------------------------ layers


def layer_loss(name, path):
    """A loss of a layer's output on the masked input, as `f(x, theta)` with `theta` the
    layer's parameters as one vector; the ring runs through `ea.parallel.context_parallel`."""
    key = jax.random.key(0)
    implementation = path if path in ("naive", "pallas") else "blockwise"
    if name == "hopfield_attention":
        layer = ea.nn.HopfieldAttention(
            DIM, num_heads=2, head_dim=2, num_steps=2, step_size=0.5, block_size=3,
            implementation=implementation, key=key,
        )  # fmt: skip
    else:
        layer = ea.nn.EnergyTransformer(
            DIM, num_heads=2, head_dim=2, num_memories=3, num_steps=1,
            implementation=implementation, key=key,
        )  # fmt: skip
    layer = jax.tree.map(lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, layer)
    params, static = eqx.partition(layer, eqx.is_inexact_array)
    theta, unravel = jax.flatten_util.ravel_pytree(params)
    _, mask = data(jnp.float64)

    def apply(layer, x):
        return layer(x, mask=mask)

    if path.startswith("ring"):
        apply = ea.parallel.context_parallel(apply, mesh_of(int(path[4:])))

    def loss(x, theta):
        return jnp.sum(jnp.sin(apply(eqx.combine(unravel(theta), static), x)))

    return loss, theta


LAYERS = {
    "hopfield_attention": {"blockwise": FIRST + SECOND[:2], "ring2": FIRST + SECOND[:2]},
    # Its loss differentiates its recall, itself a gradient descent on the energy: the
    # Hessian-vector products are third derivatives of the attention energy.
    "energy_transformer": {
        "blockwise": ("value", "grad") + SECOND[:2],
        "ring2": ("value", "grad", "hvp_reverse_over_reverse"),
        "pallas": ("value", "grad", "hvp_forward_over_reverse"),
    },
}


@functools.cache
def layer_results(name, path, names):
    (x, _, tx, _), _ = data(jnp.float64)
    f, theta = layer_loss(name, path)
    ttheta = jnp.asarray(np.random.default_rng(2).normal(size=theta.shape))
    run = jax.jit(transformations, static_argnums=(0, 5))
    return jax.device_get(run(f, x, theta, tx, ttheta, names))


@pytest.mark.parametrize(
    ("name", "path"), [(name, path) for name in LAYERS for path in LAYERS[name]]
)
def test_layers_every_path_every_transformation(name, path):
    # The naive reference computes what either path checks (cached per process).
    reference = tuple(dict.fromkeys(sum(LAYERS[name].values(), ())))
    results = {"naive": layer_results(name, "naive", reference)}
    results[path] = layer_results(name, path, LAYERS[name][path])
    run_grid(lambda p, _: results[p], [(path, LAYERS[name][path])], "float64")


# ---------------------------------------------------------------------------- implicit solves


def implicit_loss(kind, path):
    """A loss of the solution of an implicit problem whose map or energy holds attention:
    deep-equilibrium attention $z = x + \\tfrac12 \\mathrm{attention}(z, M)$ as a fixed point
    (Anderson), as a root (Newton-Krylov: GMRES on Jacobian-vector products), and as the
    minimum of an energy (Newton-Krylov: CG on Hessian-vector products)."""
    rows = lse_path(path)
    beta = 0.5
    tight = dict(rtol=1e-13, atol=1e-13)

    def attention(z, m):  # softmax(beta z m^T) m: the energy's gradient
        return jax.grad(lambda z: jnp.sum(rows(z, m, beta, None, False)) / beta)(z)

    def solve(x, m):
        if kind == "fixed_point":
            fn = lambda z, a: a[0] + 0.5 * attention(z, a[1])  # noqa: E731
            return ea.fixed_point(fn, jnp.zeros_like(x), (x, m), solver=ea.Anderson(**tight))
        solver = ea.Newton(jacobian="matrix-free", **tight)
        if kind == "root":
            fn = lambda z, a: z - a[0] - 0.5 * attention(z, a[1])  # noqa: E731
            return ea.root_find(fn, x, (x, m), solver=solver)

        def energy(z, a):
            lse = rows(z, a[1], beta, None, False)
            return 0.5 * jnp.sum(jnp.square(z - a[0])) - 0.5 * jnp.sum(lse) / beta

        return ea.minimise(energy, x, (x, m), solver=solver)

    def loss(x, m):
        return jnp.sum(jnp.sin(solve(x, m).value))

    return loss


#: Gradients, JVPs and Hessian-vector products through every solve; the fixed point (the
#: same implicit adjoint as the others) through every transformation and the ring too.
IMPLICIT = {
    "fixed_point": [
        ("blockwise", ("value", "grad", "jvp", "vmap") + SECOND[:2]),
        ("ring2", ("value", "grad", "jvp")),
    ],
    "minimise": [("blockwise", ("value", "grad", "hvp_forward_over_reverse"))],
    "root": [("blockwise", ("value", "grad", "jvp"))],
}


@pytest.mark.parametrize("kind", list(IMPLICIT))
def test_implicit_solves_every_path(kind):
    # Every solve converges to round-off on every path; the derivatives (implicit, through
    # the attention's forward-mode rule and its transpose) agree to the solves' tolerance.
    (x, m, tx, tm), _ = data(jnp.float64)

    def surface(path, names):
        f = implicit_loss(kind, path)
        return jax.jit(transformations, static_argnums=(0, 5))(f, x, m, tx, tm, names)

    run_grid(surface, IMPLICIT[kind], "implicit")


@pytest.mark.parametrize("dtype, tol", [("float64", 1e-10), ("float32", 1e-6)])
def test_implicit_gradient_through_blockwise_attention_equals_unrolled_iteration(dtype, tol):
    # Deep-equilibrium attention at seq 1024, where `auto` takes the blockwise path: the
    # implicit gradient (the adjoint linearises the map through the attention's forward-mode
    # rule and solves with its transpose) equals backpropagation through 60 unrolled steps.
    rng = np.random.default_rng(3)
    x, memory = (jnp.asarray(rng.normal(size=(1024, 4)), dtype) for _ in range(2))

    def attention_map(z, args):
        x, memory = args
        force = jax.grad(ea.hopfield_energy)(z, memory, beta=0.25)  # z - attention(z)
        return x + 0.5 * (z - force)

    def loss(x, memory, adjoint, solver, throw):
        fixed = ea.fixed_point(
            attention_map, jnp.zeros_like(x), (x, memory), solver=solver, adjoint=adjoint,
            max_steps=60, throw=throw,
        )  # fmt: skip
        return jnp.sum(jnp.sin(fixed.value))

    @jax.jit
    def both(x, memory):
        grad = jax.grad(loss, argnums=(0, 1))
        # Converged to round-off (the fixed-point solvers' defaults stop at 1e-5).
        eps = float(jnp.finfo(x.dtype).eps)
        anderson = ea.Anderson(rtol=3 * eps, atol=3 * eps)
        # The adjoint's GMRES too (its default stops at eps ** 0.6, 7e-5 in float32).
        adjoint = ea.ImplicitAdjoint(ea.GMRES(rtol=3 * eps, atol=3 * eps))
        implicit = grad(x, memory, adjoint, anderson, True)
        # Zero tolerances: all 60 Picard steps, differentiated one by one.
        picard = ea.Picard(rtol=0.0, atol=0.0)
        return implicit, grad(x, memory, ea.UnrolledAdjoint(), picard, False)

    implicit, unrolled = both(x, memory)
    if dtype == "float64":
        assert_same(implicit, unrolled, tol, "implicit vs unrolled")
    else:
        # Norm-wise in float32: both gradients are 1e-7 (norm-wise) from float64's, but
        # single entries of the implicit one (4096 unknowns, GMRES on float32 products) are
        # up to 1.5e-6 off, against 4e-7 for the unrolled one.
        for a, b in zip(implicit, unrolled, strict=True):
            assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b)) <= tol
