"""The Triton kernels as a GPU compiles them, without a GPU: every variant the launchers
can produce compiled to cubin for sm_90 (H100/H200) and sm_100 (B200), one binary per
operation whatever the token count, and 64-bit offsets (``tests/_triton_aot.py``, in a
process of its own: compiled kernels, not the interpreter). ``make test`` runs this file
with the newest Triton and, in verl's environment, with Triton 3.6 (torch 2.11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _paths import TESTS

triton = pytest.importorskip("triton")

from fp4rl.formats import get_format, list_formats  # noqa: E402
from fp4rl.kernels import aot, triton_quant  # noqa: E402


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(TESTS / "_triton_aot.py")], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_every_variant_compiles_for_hopper_and_blackwell(compiled):
    variants = aot.variants(get_format(n) for n in list_formats())
    assert compiled["variants"] == len(variants) > 0
    # every variant but the quantize-on-load GEMM's pointer-type siblings (all of them
    # under FP4RL_AOT_ALL=1: make test-long)
    assert compiled["chosen"] <= len(variants)
    assert len(variants) - compiled["chosen"] < sum(
        v.kernel.__name__ == "_qmm_kernel" for v in variants)
    assert len(compiled["compiled"]) == compiled["chosen"] * len(aot.TARGETS)
    failed = [(c["kernel"], c["constants"], c["pointers"], c["target"], c["error"][:300])
              for c in compiled["compiled"] if c["error"]]
    assert not failed, failed
    assert all(c["cubin_bytes"] > 0 for c in compiled["compiled"])


def test_the_variant_table_holds_every_launch(compiled):
    """Every launch fp4rl's functions make is a variant of the table compiled above, so a
    new variant cannot escape the ahead-of-time compile."""
    assert compiled["launched"] > 0
    assert compiled["not_in_table"] == []


def test_one_binary_per_operation_at_any_token_count(compiled):
    """1, 2, 16, 248 and 4096 tokens (Triton specializes integers equal to 1 and
    multiples of 16) give each operation one specialization key: a CUDA graph captured
    at a batch size never run eagerly compiles nothing."""
    ops = {op: keys for op, keys in compiled["keys"].items()}
    assert len(ops) >= 20
    per_kernel: dict[str, int] = {}
    for op, keys in ops.items():  # an op may launch several kernels (NVFP4: amax, blocks)
        for key in keys:
            name = f"{op}.{key.split(' ', 1)[0]}"
            per_kernel[name] = per_kernel.get(name, 0) + 1
    assert {k: n for k, n in per_kernel.items() if n != 1} == {}


def test_every_pointer_offset_is_64_bit(compiled):
    """A tensor of 2^31 elements (131,072 tokens x 18,944, Qwen2.5-7B's MLP width, in the
    backward) is addressed without overflow: no offset in any kernel's IR is 32-bit."""
    assert compiled["narrow_offsets"] == {}


def test_narrow_offsets_are_found():
    ttir = ("%1 = tt.addptr %0, %2 : tensor<32x1x!tt.ptr<f32>>, tensor<32x1xi32> loc(#l)\n"
            "%3 = tt.addptr %0, %4 : tensor<32x1x!tt.ptr<f32>>, tensor<32x1xi64> loc(#l)\n"
            "%5 = tt.addptr %6, %7 : !tt.ptr<f32>, i32 loc(#l)")
    assert len(aot.narrow_offsets(ttir)) == 2


@pytest.mark.parametrize("fmt", ["hif4", "nvfp4"])
def test_grids_stay_within_cuda_limits_for_any_row_count(fmt):
    """One grid axis (CUDA's x: 2^31 - 1 programs), whatever the rows: NVFP4 along the
    tokens of 1.05M tokens put 65,536 programs on the y axis, past its 65,535."""
    f = get_format(fmt)
    for rows, length in ((2_000_000, 4096), (4096, 2_000_000), (131_072, 18_944)):
        (programs,) = triton_quant.grid_1d(rows, length, f.block_size)
        per = triton_quant.rows_per_program(f.block_size)
        assert programs == -(-rows // per) * -(-length // f.block_size)
        assert programs <= triton_quant.MAX_PROGRAMS
    with pytest.raises(ValueError, match="programs"):
        triton_quant.grid_1d(2**40, 2**20, f.block_size)


def test_a_launch_must_match_its_variant():
    f = get_format("hif4")
    variant = triton_quant.quantize_variant(f, torch.float32, torch.float32, False, False)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="declared"):
        variant.launch((1,), x, x, x, x, 2, 64, 64, 1, 64, 1, 0, 0, x)


def test_no_float64_and_no_spills_in_any_compiled_kernel(compiled):
    """The SASS of every variant (nvdisasm from Triton's wheel): no float64 instruction,
    which a GPU runs at a fraction of float32's rate (Four Over Six's choice included: an
    exact integer comparison, triton_quant's docstring), and no local-memory access (a
    register spill) anywhere. Triton 3.6 (torch 2.11's, verl's and vLLM 0.24's stack) is
    held to the same: ``make test`` runs this file in verl's environment too."""
    assert all(c["fp64"] >= 0 for c in compiled["compiled"]), "nvdisasm missing"
    fp64 = [(c["kernel"], c["constants"], c["target"], c["fp64"], c["fp64_examples"])
            for c in compiled["compiled"] if c["fp64"]]
    assert fp64 == []
    spills = [(c["kernel"], c["constants"], c["pointers"], c["target"], c["local"])
              for c in compiled["compiled"] if c["local"]]
    assert spills == []


def test_sass_counts_find_float64_and_local_memory():
    text = ("        /*0070*/                   DADD R24, R24, -R50 ;\n"
            "        /*0080*/              @!P0 F2F.F64.F32 R2, R3 ;\n"
            "        /*0090*/                   STL [R1], R4 ;\n"
            "        /*00a0*/                   FADD R2, R3, R4 ;\n")
    from unittest import mock

    with mock.patch.object(aot, "sass", lambda cubin: text):
        fp64, local, examples = aot.sass_counts(b"")
    assert (fp64, local) == (2, 1)
    assert examples[0].startswith("DADD")
