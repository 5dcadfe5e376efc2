"""The Bazel-built package: its library needs only libc, loads and registers the custom calls
(a handler pair for every target of fa4_jax.abi.targets),
its manifest is the shipping menu, and its router picks what fa4_jax.abi.routing picks."""
import ctypes
import itertools
import os
import subprocess

import fa4_jax
from fa4_jax.runtime import ffi
from fa4_jax.abi import routing, targets
from fa4_jax.aot import menu


def main() -> None:
    library = ffi.load()
    assert os.path.samefile(os.path.dirname(library.path), os.path.join(os.path.dirname(fa4_jax.__file__), "_lib")), \
        f"loaded {library.path}, not the package's own library"
    assert library.compiled == {v.name for v in menu.MENU}, "the manifest is not the shipping menu"
    dynamic = subprocess.run(["readelf", "-d", library.path], capture_output=True, text=True,
                             check=True).stdout
    needed = {line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line}
    assert needed <= {"libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1",
                      "ld-linux-x86-64.so.2"}, needed
    lib = ctypes.CDLL(library.path)
    for target in targets.registered():
        for stage in ("Instantiate", "Execute"):
            assert hasattr(lib, target.handler + stage), f"{target.name}: no {target.handler}{stage}"
    choose = lib.Fa4ChooseVariant
    choose.restype = ctypes.c_char_p
    choose.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                       ctypes.c_int, ctypes.c_int, ctypes.c_int]
    calls = 0
    for v, seqlen_q, seqlen_k, ragged in itertools.product(
            [v for v in menu.MENU if v.tuning == "default"], (1, 64, 1000, 1024, 4096),
            (64, 1024, 1152, 8192), (False, True)):
        call = routing.Call(v.kind, v.arch, v.dtype, v.head_dim, v.head_dim_v, v.mask, v.softcap,
                            seqlen_q, seqlen_k, ragged, segments=v.segments, mask_array=v.mask_array)
        handler = choose(routing.KINDS.index(call.kind), call.arch.encode(),
                         routing.DTYPES.index(call.dtype), call.head_dim, call.head_dim_v,
                         call.mask.encode(), int(call.softcap), call.seqlen_q, call.seqlen_k,
                         int(call.ragged), int(call.top_left), int(call.segments),
                         int(call.mask_array)).decode()
        assert handler == library.choose(call).name, call
        calls += 1
    print(f"fa4_jax {fa4_jax.__version__}: {library.path} holds {len(library.compiled)} variants; "
          f"{calls} calls routed as fa4_jax.abi.routing routes them")


if __name__ == "__main__":
    main()
