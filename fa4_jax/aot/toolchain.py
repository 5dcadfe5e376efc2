"""Where the build's tools and libraries are: CUDA headers/runtime, the DSL's runtime archive, g++.

CUDA comes from CUDA_HOME when set (a toolkit), else from PyPI's nvidia/cu13 (nvidia-cuda-runtime,
-crt, -cccl), so `pip install .` needs no toolkit. Everything here is build-time only.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import subprocess
import warnings
from importlib.metadata import version


class ToolchainError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class Cuda:
    include: str
    lib: str


@functools.cache
def cuda() -> Cuda:
    home = os.environ.get("CUDA_HOME")
    if home:
        found = Cuda(os.path.join(home, "include"), os.path.join(home, "lib64"))
    else:
        try:
            import nvidia.cu13
        except ImportError as e:
            raise ToolchainError("no CUDA: set CUDA_HOME or pip install 'nvidia-cuda-runtime==13.0.*' "
                                 "'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-cccl==13.0.*'") from e
        root = list(nvidia.cu13.__path__)[0]
        found = Cuda(os.path.join(root, "include"), os.path.join(root, "lib"))
    for path in (os.path.join(found.include, "cuda_runtime.h"),
                 os.path.join(found.lib, "libcudart_static.a")):
        if not os.path.exists(path):
            raise ToolchainError(f"CUDA is incomplete: {path} is missing")
    return found


def dsl_runtime_archive() -> str:
    """The DSL's static launcher runtime (cudaLibrary load, launch), linked into the library."""
    import nvidia_cutlass_dsl

    root = list(nvidia_cutlass_dsl.__path__)[0]
    return os.path.join(root, "cu13", "lib", "libcuda_dialect_runtime_static.a")


def dsl_version() -> str:
    return version("nvidia-cutlass-dsl")


# The jax whose XLA FFI headers the library is built against: pyproject.toml's build
# requirements pin it (tests/test_build.py checks the two agree). The headers carry the FFI API
# version, and a jaxlib older than the headers refuses the library at load ("the handler's API
# version (0.5) is incompatible with the framework's API version (0.4)"), so the oldest runtime
# the package allows is the one to build against.
BUILD_JAX = "0.11.0"


def jax_version() -> str:
    return version("jax")


def jax_ffi_include() -> str:
    import jax.ffi

    if jax_version() != BUILD_JAX:
        warnings.warn(
            f"building against jax {jax_version()}'s XLA FFI headers, not {BUILD_JAX}'s: the library "
            f"will load only into jaxlib versions that accept their FFI API, which may exclude "
            f"the oldest this package allows (pip install 'jax=={BUILD_JAX}' 'jaxlib=={BUILD_JAX}' "
            f"in the build environment, as `pip install .` does)", stacklevel=2)
    return jax.ffi.include_dir()


def cxx() -> str:
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        raise ToolchainError(f"no C++ compiler: {compiler} is not on PATH (set CXX)")
    return compiler


def ffi_library_command(out: str, inputs: list[str], include_dirs: list[str],
                        defines: list[str] = ()) -> list[str]:
    """The g++ command that links C++ sources and exported kernel objects into an XLA FFI
    library (fa4_jax's, and scripts/upstream_peer/'s for the benchmark)."""
    cuda_paths = cuda()
    return [cxx(), "-std=c++17", "-O2", "-shared", "-fPIC", "-o", out, *inputs,
            *(f"-D{d}" for d in defines),
            *(f"-I{d}" for d in include_dirs), f"-I{jax_ffi_include()}", f"-I{cuda_paths.include}",
            dsl_runtime_archive(), f"-L{cuda_paths.lib}", "-lcudart_static",
            # No dependency beyond the driver and libc: static C++ runtime, and keep the static
            # archives' symbols out of the export table so they cannot clash with JAX's own.
            "-static-libstdc++", "-static-libgcc", "-Wl,--exclude-libs,ALL",
            "-ldl", "-lrt", "-lpthread"]


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolchainError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n"
                             f"{proc.stdout}{proc.stderr}")


def build_runtime_shim(out_dir: str) -> str:
    """A shared copy of the DSL runtime archive, to LD_PRELOAD into compile workers.

    export_to_c resolves the launcher's runtime symbols (_cudaLaunchKernelEx, ...) in-process
    while it writes the object, and only the static archive defines them.
    """
    os.makedirs(out_dir, exist_ok=True)
    shim = os.path.join(out_dir, "libcuda_dialect_runtime.so")
    run([cxx(), "-shared", "-o", shim, "-Wl,--whole-archive", dsl_runtime_archive(),
         "-Wl,--no-whole-archive", f"-L{cuda().lib}", f"-Wl,-rpath,{cuda().lib}",
         "-l:libcudart.so.13"])
    return shim


def compile_env(shim: str, dump_dir: str) -> dict[str, str]:
    """Environment of a compile worker: LD_PRELOAD only takes effect at process start."""
    env = dict(os.environ)
    env["LD_PRELOAD"] = " ".join(p for p in (shim, env.get("LD_PRELOAD")) if p)
    env["CUTE_DSL_DUMP_DIR"] = dump_dir  # --keep-cubin writes the cubins here
    return env


def build_paths() -> dict[str, str]:
    """Where this environment's build inputs are: what the Bazel build's repository rule
    (bazel/build_env.bzl) links against, so both builds take them from the same place."""
    cuda_paths = cuda()
    return {"xla_ffi_include": jax_ffi_include(), "cuda_include": cuda_paths.include,
            "cuda_lib": cuda_paths.lib, "dsl_runtime_archive": dsl_runtime_archive()}


if __name__ == "__main__":
    import json
    import sys

    json.dump(build_paths(), sys.stdout)
