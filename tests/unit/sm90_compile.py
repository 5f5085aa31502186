"""Compile every Triton kernel of vllm_ddtree for an H100/H200 (sm_90) on a machine without a GPU.

The unit tests run the kernels through Triton's interpreter, which runs numpy, not the compiler: a kernel that the
interpreter accepts can still fail to compile (a type that differs between the branches of an ``if``, a shape the
compiler refuses), and until now only a GPU session found out. Triton's compiler and ``ptxas`` need no GPU, so here
a driver that compiles for sm_90 and launches nothing stands in for CUDA's, and unit tests that launch the kernels
run on top of it. Their assertions then fail (nothing ran), and that is ignored; a compilation error is not. Every
``*_kernel`` of the package must have been compiled at least once, so a kernel no listed test reaches fails too.
What is compiled is what the GPU compiles (Triton's own ``ptxas`` from its wheel, sm_90 machine code), and a kernel
asking for more shared memory than an H200 block has fails too; what only a launch shows (wrong results, faults)
is not checked.

Run by ``test_sm90_compile.py`` in its own process (no ``TRITON_INTERPRET``); prints one line per kernel.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import traceback
from pathlib import Path

import torch
import triton.backends as triton_backends
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction

H200_SHARED_MEMORY = 232448  # bytes per block on sm_90 (opt-in maximum)


class _NoBinary:
    def load_binary(self, name, kernel, shared, device):
        return None, None, 0, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": H200_SHARED_MEMORY, "multiprocessor_count": 132, "warpSize": 32}


class _NoLaunch:
    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        pass


class _InactiveDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return False


class CompileOnlyDriver(DriverBase):
    """Targets sm_90, loads nothing, launches nothing; tensors stay on the CPU."""

    launcher_cls = _NoLaunch

    def __init__(self):
        self.utils = _NoBinary()

    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0


class _NoCompiler:
    @staticmethod
    def supports_target(target) -> bool:
        return False


# CUDA's compiler behind the compile-only driver: the one active driver (vLLM, imported by some tests, keeps Triton
# only then; its CPU wheel also wants a "cpu" backend entry, as in tests/unit/conftest.py).
_nvidia = triton_backends.backends["nvidia"]
triton_backends.backends["nvidia"] = triton_backends.Backend(compiler=_nvidia.compiler, driver=CompileOnlyDriver)
triton_backends.backends["cpu"] = triton_backends.Backend(compiler=_NoCompiler, driver=_InactiveDriver)

# (test module, test function, arguments): production shapes where the tests offer them.
CALLS = [
    ("test_tree_build", "test_row_logsumexp_kernel_equals_torch", {"dtype": torch.bfloat16}),
    ("test_tree_build", "test_triton_topk_equals_the_torch_topk",
     {"dtype": torch.bfloat16, "method": "chunks", "vocab": 5000, "k": 16}),
    ("test_tree_build", "test_triton_topk_equals_the_torch_topk",
     {"dtype": torch.bfloat16, "method": "threshold", "vocab": 5000, "k": 8}),
    ("test_tree_build", "test_triton_sort_equals_torch_stable_sort", {"rows": 2, "cols": 300, "keep": 64}),
    ("test_tree_build", "test_build_with_triton_sort_matches_heap", {}),
    ("test_tree_sampler", "test_triton_walk_equals_the_torch_walk", {"budget": 16, "depth": 15, "max_depth": 15,
                                                                     "vocab": 12}),
    ("test_tree_attention", "test_matches_dense_reference",
     {"dtype": torch.bfloat16, "g": 1, "d": 128, "bs": 16, "budget": 16}),
    ("test_tree_attention", "test_kv_splits", {"splits": 4}),
    ("test_tree_attention", "test_merges_a_prefix_attended_elsewhere",
     {"dtype": torch.bfloat16, "empty_lse": float("inf")}),
    ("test_kv_compact", "test_random_batch_several_layers", {"dtype": torch.bfloat16, "bs": 16}),
    ("test_hybrid_gdn", "test_tree_conv_kernel_matches_reference", {"seed": 0}),
    ("test_hybrid_gdn", "test_tree_gdn_kernel_matches_reference", {"seed": 0}),
    ("test_hybrid_gdn", "test_tree_gdn_with_deferred_leaves_computes_the_same_bits", {"seed": 0}),
    ("test_hybrid_gdn", "test_move_conv_columns_equals_the_relayout_plan", {"seed": 0}),
    ("test_hybrid_gdn", "test_stash_keeps_a_layers_rows_in_one_launch", {"tokens": 70}),
    ("test_mrv2_ddtree", "test_prepare_rows_kernel_equals_its_torch_reference", {"seed": 0, "tamper": "mrope"}),
    ("test_mrv2_ddtree", "test_chain_ancestor_bits_fill_whole_words_in_kernel_and_reference", {}),
    ("test_mrv2_ddtree", "test_handover_files_each_batch_row_under_its_request_slot_with_a_new_epoch",
     {"impl": "triton", "chains": True, "budget": 64}),
    ("test_mrv2_ddtree", "test_handover_files_each_batch_row_under_its_request_slot_with_a_new_epoch",
     {"impl": "triton", "chains": False, "budget": 64}),
    ("test_tree_build", "test_build_matches_heap_random",
     {"budget": 16, "vocab_vs_budget": "vocab_above_budget", "build": {"use_triton": True}}),
]


def linearise_a_walked_step() -> None:
    """The linearise kernel as the verify core launches it after a walk (M-RoPE too): two requests of 17 rows."""
    from vllm_ddtree.verify_rows import PreparedRows, RowBuffers, RowInputs, linearise_rows_triton

    num_reqs, width, tokens = 2, 17, 34
    buffers = RowBuffers(num_reqs, tokens, torch.device("cpu"))
    positions = torch.arange(tokens)
    rows = RowInputs(torch.arange(num_reqs), torch.tensor([0, width, tokens], dtype=torch.int32), torch.arange(tokens),
                     torch.zeros(tokens, dtype=torch.int64), positions, positions.repeat(3, 1), num_reqs, tokens)
    prepared = PreparedRows(buffers.shift, buffers.row_request, buffers.row_node, buffers.root_rows,
                            buffers.row_starts, buffers.has_tree, buffers.refused_fresh, block_nodes=32)
    accepted = torch.full((num_reqs, 16), -1, dtype=torch.int32)
    linearise_rows_triton(rows, prepared, accepted, torch.arange(tokens))


def package_kernels() -> dict[str, JITFunction]:
    """Every ``@triton.jit`` function named ``*_kernel`` in vllm_ddtree (the others are inlined helpers)."""
    import vllm_ddtree

    kernels = {}
    for info in pkgutil.walk_packages(vllm_ddtree.__path__, "vllm_ddtree."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # a module of another platform's path (e.g. CUDA-only imports)
            continue
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel") and value.__module__ == info.name:
                kernels[f"{info.name}.{name}"] = value
    return kernels


def compiled(kernel: JITFunction) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def register_use(kernel: JITFunction) -> list[str]:
    """``registers/spilled bytes`` of each compiled variant, from ``ptxas -v`` on its PTX (the compile-only driver
    loads no binary, so Triton never reports them here). A kernel near 255 registers or spilling is worth a look."""
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    uses = []
    for cache in kernel.device_caches.values():
        for variant in cache[0].values():
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
                ptx.write(variant.asm["ptx"])
                ptx.flush()
                log = subprocess.run([ptxas, "-arch=sm_90a", "-v", ptx.name, "-o", "/dev/null"], capture_output=True,
                                     text=True).stderr
            registers = re.search(r"Used (\d+) registers", log)
            spills = re.search(r"(\d+) bytes spill stores", log)
            uses.append(f"{registers.group(1) if registers else '?'}/{spills.group(1) if spills else '?'}")
    return uses


def main() -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    failures = []
    calls = [(f"{module}.{name}{kwargs}", getattr(importlib.import_module(module), name), kwargs)
             for module, name, kwargs in CALLS]
    calls.append(("linearise_a_walked_step", linearise_a_walked_step, {}))
    for label, test, kwargs in calls:
        try:
            test(**kwargs)
        except (CompilationError, OutOfResources):  # refused by the compiler, or past sm_90's shared memory
            failures.append(label)
            traceback.print_exc()
        except Exception:  # nothing ran, so the test's own checks fail: only the compilation counts here
            pass
    kernels = package_kernels()
    for name, kernel in sorted(kernels.items()):
        count = compiled(kernel)
        print(f"{name}: {count} sm_90 variant(s), registers/spilled bytes {' '.join(register_use(kernel))}")
        if count == 0:
            failures.append(f"{name}: no listed test launched it (add one to CALLS)")
    print(f"{len(kernels)} kernels; failures: {failures}")
    return 1 if failures or not kernels else 0


if __name__ == "__main__":
    sys.exit(main())
