"""The GPU side of the probe process: the library's probe C API (ffi/probe.cc) through ctypes.

`Fa4Args` mirrors ffi/dispatch.h's struct; `check_layout` holds it to the library's own
description (Fa4ArgsLayout) before anything is launched. `Device.run` launches one variant on
one `calls.KernelCall`: every buffer allocated for that call alone (the user's process may hold
most of the GPU's memory), results and workspaces filled with 0xFF bytes first (NaN in every
float dtype, -1 in int32), so that anything a kernel leaves unwritten fails the comparison.

Errors come back as `CudaError`, whose `stage` says what it means: "load" (the module does not
load; the context is intact), "launch" or "sync" (the kernel faulted or could not start; the
context is lost), "memory" (allocation or copies before the launch: the environment, not the
kernel).
"""
from __future__ import annotations

import ctypes
import json

import numpy as np

from fa4_jax.abi import routing
from fa4_jax.runtime.probe.calls import KernelCall

_POINTER, _INT32, _FLOAT32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float
_KINDS = {_POINTER: "pointer", _INT32: "int32", _FLOAT32: "float32"}


class Fa4Args(ctypes.Structure):
    """ffi/dispatch.h's Fa4Args, field for field."""

    _fields_ = [(name, _POINTER) for name in (
        "q", "k", "v", "out", "lse", "seq_used_q", "seq_used_k", "q_segment_ids", "kv_segment_ids",
        "row_spans", "key_spans", "mask_bits", "d_out", "d_lse", "dq", "dk", "dv", "dq_accum", "dpsum",
        "lse_log2", "semaphore")] + [(name, _INT32) for name in (
            "b", "seqlen_q", "seqlen_k", "heads", "heads_k", "b_lengths", "b_segments", "q_chunks",
            "k_chunks", "b_mask", "k_words", "b_dlse", "seqlen_q_pad", "semaphore_blocks", "dq_copies")] + [
        ("softmax_scale", _FLOAT32), ("softcap", _FLOAT32), ("window_left", _INT32),
        ("window_right", _INT32), ("top_left", _INT32), ("deterministic", _INT32), ("num_sms", _INT32)]

    def __init__(self, **fields):
        # The C++ defaults (dispatch.h) that are not zero.
        super().__init__(**{"dq_copies": 1, "softmax_scale": 1.0, **fields})


def layout() -> dict:
    """Fa4Args' layout as ffi/probe.cc's Fa4ArgsLayout describes the C++ struct."""
    return {"size": ctypes.sizeof(Fa4Args),
            "fields": [[name, getattr(Fa4Args, name).offset, ctypes.sizeof(kind), _KINDS[kind]]
                       for name, kind in Fa4Args._fields_]}


def check_layout(lib) -> None:
    """Raises RuntimeError unless `Fa4Args` matches the library's struct field for field."""
    theirs = json.loads(lib.Fa4ArgsLayout().decode())
    if theirs != layout():
        raise RuntimeError(f"fa4_jax.runtime.probe.device.Fa4Args does not match the library's Fa4Args "
                           f"(ffi/dispatch.h): update the mirror. Library: {theirs}; mirror: {layout()}")


class CudaError(Exception):
    def __init__(self, stage: str, what: str, code: int, name: str, text: str):
        super().__init__(f"{what}: {name} ({text})")
        self.stage, self.code, self.name = stage, code, name


_SIGNATURES = {
    "Fa4ArgsLayout": (ctypes.c_char_p, []),
    "Fa4CudaDriverVersion": (ctypes.c_int, []),
    "Fa4ProbeOpenDevice": (ctypes.c_int, [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]),
    "Fa4ProbeMalloc": (ctypes.c_int, [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]),
    "Fa4ProbeFree": (ctypes.c_int, [ctypes.c_void_p]),
    "Fa4ProbeCopyToDevice": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "Fa4ProbeCopyToHost": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "Fa4ProbeMemset": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]),
    "Fa4ProbeLoad": (ctypes.c_int, [ctypes.c_char_p]),
    "Fa4ProbeLaunch": (ctypes.c_int, [ctypes.c_char_p, ctypes.POINTER(Fa4Args), ctypes.c_void_p,
                                      ctypes.POINTER(ctypes.c_int)]),
    "Fa4ProbeSynchronize": (ctypes.c_int, []),
    "Fa4ProbeErrorName": (ctypes.c_char_p, [ctypes.c_int]),
    "Fa4ProbeErrorString": (ctypes.c_char_p, [ctypes.c_int]),
    "Fa4ChooseVariant": (ctypes.c_char_p, [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_char_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_int, ctypes.c_int]),
}


def open_library(path: str):
    """The library at `path` with the probe API's signatures declared and its Fa4Args checked."""
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in _SIGNATURES.items():
        function = getattr(lib, name)
        function.restype, function.argtypes = restype, argtypes
    check_layout(lib)
    return lib


def handler_choice(lib, call: routing.Call) -> str:
    """The variant the library's handlers run for `call` (ffi/common.cc's Choose), or ""."""
    return lib.Fa4ChooseVariant(
        routing.KINDS.index(call.kind), call.arch.encode(), routing.DTYPES.index(call.dtype), call.head_dim,
        call.head_dim_v, call.mask.encode(), int(call.softcap), call.seqlen_q, call.seqlen_k, int(call.ragged),
        int(call.top_left), int(call.segments), int(call.mask_array)).decode()


class Device:
    """One GPU, opened in this process through the library at `path`."""

    def __init__(self, path: str):
        self.lib = open_library(path)

    def _check(self, code: int, stage: str, what: str) -> None:
        if code != 0:
            raise CudaError(stage, what, code, self.lib.Fa4ProbeErrorName(code).decode(),
                            self.lib.Fa4ProbeErrorString(code).decode())

    def open(self, ordinal: int) -> dict:
        """Makes the device current, creates its context; its facts (ffi/probe.cc)."""
        info = ctypes.create_string_buffer(4096)
        self._check(self.lib.Fa4ProbeOpenDevice(ordinal, info, len(info)), "open", f"opening device {ordinal}")
        return json.loads(info.value.decode())

    def load(self, variant: str) -> None:
        self._check(self.lib.Fa4ProbeLoad(variant.encode()), "load", f"loading {variant}")

    def run(self, variant: str, call: KernelCall) -> dict:
        """Launches `variant` on `call`, waits, and returns its results (name -> numpy array)."""
        allocations = []
        try:
            pointers = {name: self._upload(array, allocations) for name, array in call.inputs.items()}
            buffers = {name: self._poisoned(shape, dtype, allocations)
                       for name, (shape, dtype) in {**call.results, **call.workspaces}.items()}
            args = Fa4Args(**pointers, **buffers, **call.scalars)
            launcher = ctypes.c_int(0)
            self._check(self.lib.Fa4ProbeLaunch(variant.encode(), ctypes.byref(args), None, ctypes.byref(launcher)),
                        "launch", f"launching {variant} (launcher returned {launcher.value})")
            self._check(self.lib.Fa4ProbeSynchronize(), "sync", f"running {variant}")
            return {name: self._download(buffers[name], shape, dtype) for name, (shape, dtype) in call.results.items()}
        finally:
            for pointer in allocations:
                self.lib.Fa4ProbeFree(pointer)  # after a fault the context is gone; nothing to free

    def _allocate(self, nbytes: int, allocations: list) -> int | None:
        if nbytes == 0:
            return None
        pointer = ctypes.c_void_p()
        self._check(self.lib.Fa4ProbeMalloc(nbytes, ctypes.byref(pointer)), "memory", f"allocating {nbytes} bytes")
        allocations.append(pointer.value)
        return pointer.value

    def _upload(self, array: np.ndarray, allocations: list) -> int | None:
        array = np.ascontiguousarray(array)
        pointer = self._allocate(array.nbytes, allocations)
        if pointer is not None:
            self._check(self.lib.Fa4ProbeCopyToDevice(pointer, array.ctypes.data, array.nbytes), "memory",
                        "copying an operand to the device")
        return pointer

    def _poisoned(self, shape, dtype, allocations: list) -> int | None:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        pointer = self._allocate(nbytes, allocations)
        if pointer is not None:
            self._check(self.lib.Fa4ProbeMemset(pointer, 0xFF, nbytes), "memory", "filling a result with NaN")
        return pointer

    def _download(self, pointer, shape, dtype) -> np.ndarray:
        host = np.empty(shape, dtype)
        if host.nbytes:
            self._check(self.lib.Fa4ProbeCopyToHost(host.ctypes.data, pointer, host.nbytes), "sync",
                        "copying a result back")
        return host
