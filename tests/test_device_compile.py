"""The public programs compiled by the chips' own compilers, on this CPU (deviceless AOT).

libtpu's compiler for TPU v4, v5e, v5p and v6e; the CUDA plugin's (Triton, then `ptxas`)
for A100 (sm_80), H100 (sm_90) and B200 (sm_100). Each chip compiles in a process of its
own (`benchmarks/device_compile.py`), two at a time.

What it covers, per chip (`device_compile.matrix(chip, "ci")`):

- the five forms (value, value and gradient, JVP, HVP, linearize) of the causal
  log-sum-exp at 64k and 128k keys (bfloat16, head size 128): they compile, and their
  temporary device memory at 128k is at most 2.2x that at 64k (O(seq)), counted in every
  memory space and in HBM alone (`memory_analysis()`). On TPUs XLA moves the buffers that
  fit out of HBM (`ea.aot.Inspection`), more at 64k than at 128k; where HBM alone then grows
  faster, the form is compiled again with that move off, every buffer in HBM
  (`device_compile.hbm_controls`), and checked there;
- a rotation through the attention programs x forms (every mask kind and the vmapped heads
  meet every form on each platform), the dtypes (float16 on GPUs), the lengths (1000, 64k,
  128k) and the head sizes (64, 80, 128, 256) cycling;
- the layers and models (`HopfieldAttention`, `EnergyTransformer`, the energy-based
  transformer; bfloat16, head size 64): each one's value and gradient on a GPU and on a
  TPU, and `HopfieldAttention`'s HVP (`device_compile.MODEL_CASES`). Their kernels are the
  attention programs'; their other programs (MLPs, the layers' scan) took more than half
  of the check's time when every form of them compiled on both platforms;
- on the H100 and the B200, sequences shorter than a tile (17 tokens, the float32 HVP with
  a dense mask; 5 tokens, a float32 JVP with the diagonal excluded, whose kernels loop
  over one block, and the causal float32 gradient with the diagonal excluded, whose
  forward does; 8 tokens, that program's bfloat16 JVP, whose forward takes other warps
  than float32's): each spilled on the B200 once; on every GPU, a control kernel;
- the causal log-sum-exp's value and gradient in 64-bit mode (`jax_enable_x64`; float32,
  1000 tokens): every TPU kernel failed to compile there until 2026-12-02.

Each chip compiles at its compilers' default optimization (`device_compile.default_compilers`
removes the suite's faster settings, which its subprocesses would otherwise inherit).

Every program takes the energy attention's kernels (found by name, under `vmap` too). And
for every kernel of the energy attention: a tensor-core instruction (`wgmma`,
`tcgen05.mma`, `mma.sync`) in each GPU kernel, and no spilled register on the H100 and
the B200 (`ptxas -v`); a control kernel that
spills and multiplies no matrix shows both checks failing where they should. Device
memory: no form holds a score matrix at 128k keys, and the memory at 128k is at most
2.2x that at 64k.
The whole matrix (`--matrix full`) is `benchmarks/device_compile.py --all`'s.

Needs the `device-compile` extra; `.ci/run` runs it on its own (`pytest -m
device_compile`), beside the main suite. Skipped where the extra is not installed.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.device_compile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import device_compile  # noqa: E402

MISSING = [
    name
    for name in ("libtpu", "jax_plugins.xla_cuda12", "nvidia.cuda_nvcc")
    if importlib.util.find_spec(name.split(".")[0]) is None
    or importlib.util.find_spec(name) is None
]
if MISSING:
    pytest.skip(
        f"needs the device-compile extra (missing: {', '.join(MISSING)}): "
        'pip install ".[device-compile]"',
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def results():
    rows = device_compile.run_all("ci", workers=2)
    print("\n".join(device_compile.summary(rows)))
    return rows


@pytest.mark.parametrize("chip", device_compile.CHIPS)
def test_every_case_compiles(results, chip):
    mine = [r for r in results if r["chip"] == chip]  # the HBM controls too
    ci = device_compile.matrix(chip, "ci")
    assert len(mine) == len(ci) + len(device_compile.hbm_controls(chip, results))
    failed = [
        f"{r.get('program')} {r.get('form')} {r.get('dtype')} {r.get('seq')}x{r.get('head')}: "
        f"{r['error'][:300]}"
        for r in mine
        if not r["ok"]
    ]
    assert not failed, "\n".join(failed)
    # At the compilers' default optimization, not the suite's faster settings (conftest.py).
    assert all(r["optimised"] for r in mine if r["ok"])


@pytest.mark.parametrize("chip", device_compile.CHIPS)
def test_every_program_runs_the_kernels(results, chip):
    # Every program compiled takes the energy attention's kernels (no silent fallback to
    # XLA's ops), under `jax.vmap` too (a TPU kernel batched by vmap is named "vmap_" + its
    # name: the layers' and models' kernels, and the heads', were missed by name before).
    bare = [r for r in results if r["chip"] == chip and r["ok"] and not r["kernels"]]
    assert not bare, [(r["program"], r["form"], r["dtype"]) for r in bare]


def _kernels(results, chip):
    return [
        (r["program"], r["form"], r["dtype"], r["head"], k)
        for r in results
        if r["chip"] == chip and r["ok"] and r["program"] != device_compile.CONTROL
        for k in r["kernels"]
    ]


@pytest.mark.parametrize("chip", device_compile.GPUS)
def test_gpu_kernels_use_tensor_cores(results, chip):
    kernels = _kernels(results, chip)
    assert kernels, "no energy-attention kernel found"
    bare = [k for k in kernels if not k[-1].get("matrix_instructions")]
    assert not bare, f"kernels without tensor-core instructions: {bare[:5]}"
    # A program's kernels stay within the chip's shared memory (the compile would fail
    # otherwise) and the float32 passes run on tensor cores too.
    float32 = [k for k in kernels if k[2] == "float32"]
    assert float32 and all("tf32" in " ".join(k[-1]["matrix_instructions"]) for k in float32)


@pytest.mark.parametrize("chip", device_compile.NO_SPILLS)
def test_gpu_kernels_spill_nothing(results, chip):
    spilled = [k for k in _kernels(results, chip) if k[-1].get("spill_bytes")]
    assert not spilled, f"kernels that spill registers: {spilled[:5]}"


@pytest.mark.parametrize("chip", device_compile.CHIPS)
def test_device_memory_is_linear_in_the_sequence(results, chip):
    # Temporary device memory (XLA's buffer assignment of the compiled program, every memory
    # space) at 128k keys against 64k: at most 2.2x, in every form.
    by = device_compile.memory(results, chip, "temp_bytes_all_spaces")
    for form in device_compile.FORMS:
        small, large = by[(form, 65536)], by[(form, 131072)]
        assert small > 0, f"{form}: no temporary memory read from the buffer assignment"
        assert large <= 2.2 * small + 1, f"{form}: {small} -> {large} bytes"


@pytest.mark.parametrize("chip", device_compile.CHIPS)
def test_device_memory_in_hbm_is_linear_in_the_sequence(results, chip):
    # The same in the memory `memory_analysis()` counts (HBM on TPUs): every form, on every
    # chip. On a TPU, XLA moves the buffers that fit out of HBM (into VMEM; v4's CMEM), at
    # 64k more of them than at 128k: where HBM alone grows more than 2.2x (2026-11-30, JAX
    # 0.10.2: value and gradient on v4, v5e and v6e, 2.99-5.93x; linearize on v4 and v6e,
    # 3.99x), the form is compiled again with that assignment off (`hbm_controls`), and then
    # every buffer the program holds is in HBM: it must grow at most 2.2x there.
    by = device_compile.memory(results, chip, "temp_bytes")
    control = device_compile.memory(results, chip, "temp_bytes", hbm_only=True)
    for form in device_compile.FORMS:
        small, large = by[(form, 65536)], by[(form, 131072)]
        if large <= 2.2 * small + 1:
            assert (form, 65536) not in control
            continue
        assert chip in device_compile.HBM_ONLY, f"{form}: {small} -> {large} bytes"
        moved, held = control[(form, 65536)], control[(form, 131072)]
        assert held <= 2.2 * moved + 1, f"{form}, every buffer in HBM: {moved} -> {held} bytes"
        # The control holds in HBM what the assignment moved out of it.
        assert moved > small, f"{form}: the control moved nothing back ({small}, {moved})"


@pytest.mark.parametrize("chip", device_compile.CHIPS)
def test_device_memory_holds_no_score_matrix(results, chip):
    # Whatever XLA keeps live, no form holds anything like a (seq, seq) matrix per head at
    # 128k keys (32 GiB in bfloat16): its temporary memory stays under 1/16 of those.
    for r in results:
        if r["chip"] == chip and r["ok"] and r["seq"] == 131072:
            scores = 131072**2 * 2 * (8 if r["program"] == "heads" else 1)
            assert r["temp_bytes_all_spaces"] < scores / 16, (
                r["program"],
                r["form"],
                r["temp_bytes"],
            )


@pytest.mark.parametrize("chip", device_compile.GPUS)
def test_the_checks_see_spills_and_bare_kernels(results, chip):
    # The control: a kernel with a (128, 128) float32 accumulator on 32 threads spills, and
    # does no matrix product; the report says so (`ptxas -v`).
    (row,) = [r for r in results if r["chip"] == chip and r["program"] == device_compile.CONTROL]
    (kernel,) = row["kernels"]
    assert kernel.get("spill_bytes", 0) > 0 and not kernel.get("matrix_instructions")
