"""The GPU session's configuration: where the fixtures are, which families and test files it
runs, and the sizes of its workloads (each `(real, dry run)`), shared by the session's command
(`gpu_session.py`) and its in-process checks (`gpu_session_checks.py`)."""
from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).absolute().parent.parent
#: where the tests look for the Hugging Face fixtures (tests/conftest.py)
TEST_FIXTURES = REPO / "tests" / "fixtures"
FIXTURES_ENV = "EINPAGE_GPU_SESSION_FIXTURES"   # --fixtures, for the children
#: the fixtures this session uses (`--fixtures`; by default the repository's own, which travel
#: with the checkout)
FIXTURES = Path(os.environ.get(FIXTURES_ENV) or TEST_FIXTURES)
#: every Hugging Face fixture family (tests/fixtures/<name>)
FAMILIES = ("tiny-llama-f32", "tiny-llama-bf16", "tiny-llama31", "tiny-mistral", "tiny-qwen2",
            "tiny-qwen3", "tiny-mixtral")
#: the fixture the sanitizer, the soak and the decode checks run
SMALL_FIXTURE = "tiny-llama-f32"
#: the test files that run on the GPU (the rest of the suite is `pytest-cpu`)
GPU_TEST_FILES = ("tests/test_cuda_backend.py", "tests/test_cuda_source.py",
                  "tests/test_cuda_memory.py", "tests/test_gemm_plan.py",
                  "tests/test_cupy_api.py", "tests/test_nvrtc.py", "tests/test_cli_backends.py")
#: einpage's own dependencies (pyproject.toml): without one nothing runs
REQUIRED = ("numpy", "opt_einsum", "sympy", "safetensors", "ml_dtypes", "tqdm", "tokenizers")
OPTIONAL = ("pytest", "hypothesis", "cupy", "torch", "transformers", "accelerate", "matplotlib")
FAMILIES_ENV = "EINPAGE_GPU_SESSION_FAMILIES"  # --families: the families `agree` checks
XDIST_ENV = "EINPAGE_GPU_SESSION_XDIST"  # --xdist N: pytest-cpu on N workers (pytest-xdist)

# Workloads: (real, dry run). The dry run keeps every command's shape on sizes a CPU runs in
# seconds (the `small` preset for llama-7b/13b, fewer tokens and steps).
LLAMA_PREFILL_SEQ = (2048, 32)        # tokens of the llama prefill rows (B=1)
DECODE_PROMPT = (512, 16)             # prompt of the decode rows
DECODE_STEPS = (64, 6)                # decode steps (new tokens = steps + 1)
SOAK_STEPS = (1000, 20)               # decode steps of the soak
MEASURED_PASSES = 5                   # prefill rows: the first pass and the median of 4 more
SOAK_MARK = 10                        # the soak compares memory at this step and the last
AGREE_NEW_TOKENS = 16                 # new tokens of the cupy-vs-threads generate check
SAN_DECODE_STEPS = 32                 # decode steps of the sanitizer's decode run
PEER_BUDGET = "4GB"                   # the device budget einpage and accelerate get (issue 27)
FITS_BUDGET = "40GB"                  # a budget llama-7b fits in (against eager PyTorch)
PEERS_DEADLINE_S = 300                # bench/peers.py stops starting work after this


def fixture(name: str) -> Path:
    """The fixture directory `name` of this session (`FIXTURES`)."""
    return FIXTURES / name


def npy_shape(path: Path) -> tuple[int, ...]:
    """The shape of the array saved at `path` (a fixture's token ids)."""
    import numpy as np
    return tuple(np.load(path).shape)


def slug(name: str) -> str:
    """`name` (a GPU's) as a file-name part: lower-case letters, digits and dashes."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"
