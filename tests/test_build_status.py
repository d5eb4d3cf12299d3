"""CMakeLists.txt: configuring says in one line whether the extension gets its CUDA backend, and why not."""
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
needs_cmake = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")


def _configure(tmp_path, *defines):
    done = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), f"-DPython_EXECUTABLE={sys.executable}",
                           *defines], capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "FICCO_CUDA"})
    lines = re.findall(r"^-- ficco_jax: CUDA backend.*$", done.stdout, re.MULTILINE)
    return done, lines


@needs_cmake
def test_a_cpu_only_build_says_so_and_why(tmp_path):
    done, lines = _configure(tmp_path, "-DFICCO_CUDA=OFF")
    assert done.returncode == 0, done.stderr[-2000:]
    assert lines == ["-- ficco_jax: CUDA backend OFF: FICCO_CUDA=OFF (a CPU-only build was asked for); the extension "
                     "has its CPU backend only, so copy-engine schedules (comm=\"dma\") do not run on GPUs"], lines


@needs_cmake
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_a_cuda_build_names_its_compiler_and_cublaslt(tmp_path):
    # cuBLASLt given by hand (empty stand-ins): configuring only finds files, it links nothing
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cublasLt.h").touch()
    (tmp_path / "libcublasLt.so").touch()
    done, lines = _configure(tmp_path, "-DFICCO_CUDA=ON", f"-DFICCO_CUBLASLT_INCLUDE_DIR={tmp_path / 'include'}",
                             f"-DFICCO_CUBLASLT_LIBRARY={tmp_path / 'libcublasLt.so'}")
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(lines) == 1 and re.fullmatch(
        rf"-- ficco_jax: CUDA backend ON \(nvcc \S*nvcc \d+\.\d+\.\d+, cuBLASLt {re.escape(str(tmp_path))}/libcublasLt.so, "
        r"architectures \S+\)", lines[0]), lines
