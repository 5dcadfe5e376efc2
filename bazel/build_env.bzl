"""fa4_build_env: the Python build environment's headers and archives as Bazel targets.

Runs `$FA4_PYTHON -m fa4_jax.aot.toolchain` (default python3; an environment with the [test]
extra's packages), which prints where the XLA FFI headers, the CUDA runtime and the DSL's
launcher runtime are, and links them into the repository it defines.
"""

def _fa4_build_env_impl(ctx):
    python = ctx.os.environ.get("FA4_PYTHON", "python3")
    root = ctx.path(Label("//:WORKSPACE")).dirname
    found = ctx.execute([python, "-m", "fa4_jax.aot.toolchain"], working_directory = str(root),
                        environment = {"PYTHONPATH": str(root)})
    if found.return_code != 0:
        fail("fa4_jax: `%s -m fa4_jax.aot.toolchain` failed; set FA4_PYTHON to a Python with " % python +
             "fa4_jax's build requirements (pip install -e '.[test]'):\n" + found.stderr)
    paths = json.decode(found.stdout)
    ctx.symlink(paths["xla_ffi_include"], "xla_ffi_include")
    ctx.symlink(paths["cuda_include"], "cuda_include")
    ctx.symlink(paths["cuda_lib"] + "/libcudart_static.a", "cuda_lib/libcudart_static.a")
    ctx.symlink(paths["dsl_runtime_archive"], "dsl/libcuda_dialect_runtime_static.a")
    ctx.file("BUILD", """
load("@rules_cc//cc:defs.bzl", "cc_library")

cc_library(
    name = "xla_ffi",
    hdrs = glob(["xla_ffi_include/xla/ffi/api/*.h"]),
    includes = ["xla_ffi_include"],
    visibility = ["//visibility:public"],
)

cc_library(
    name = "cuda_runtime",
    srcs = ["cuda_lib/libcudart_static.a"],
    hdrs = glob(["cuda_include/**"]),
    includes = ["cuda_include"],
    linkopts = ["-ldl", "-lrt", "-lpthread"],
    visibility = ["//visibility:public"],
)

cc_library(
    name = "dsl_runtime",
    srcs = ["dsl/libcuda_dialect_runtime_static.a"],
    visibility = ["//visibility:public"],
)
""")

fa4_build_env = repository_rule(
    implementation = _fa4_build_env_impl,
    environ = ["FA4_PYTHON", "PATH", "CUDA_HOME"],
    local = True,
)
