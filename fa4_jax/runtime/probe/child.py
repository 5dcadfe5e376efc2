"""The probe process: `python -m fa4_jax.runtime.probe`, one JSON job on stdin (fa4_jax.runtime.probe.protocol),
started by fa4_jax.runtime.probe.runner with JAX on the CPU (JAX_PLATFORMS=cpu: JAX builds the segment
operands, as it does for users, and never touches the GPU) and CUDA_VISIBLE_DEVICES narrowed to
the caller's GPU.

It opens the device through the library's probe API, then for each variant in order waits for
its problems' inputs and reference (computed on the CPU by a pool of threads, a few variants
ahead), prints `START`, loads and runs it, and prints its `RESULT`. After a fault it exits at
once with status 3: the CUDA context is lost, and the parent starts a new process for the
variants left.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import sys

from fa4_jax.runtime import ffi
from fa4_jax.abi import routing
from fa4_jax.runtime.probe import device as gpu
from fa4_jax.runtime.probe import cases, judge, problems
from fa4_jax.runtime.probe.protocol import DEVICE, RESULT, START, Verdict

FAULT_STATUS = 3
# Threads computing the references ahead (and variants prepared ahead): more cost memory (a
# d256 batch of many tiles holds ~300 MB of reference) for little, the GIL being shared.
MAX_WORKERS = 8


def _say(prefix: str, text: str) -> None:
    print(prefix + text, flush=True)


def _serves(library: ffi.Library, lib):
    """serves(call, variant): both the library's own rule (ffi/common.cc) and fa4_jax.abi.routing's
    on the manifest run `variant` for `call`."""
    python_rule = problems.routing_rule(library.routes, library.compiled)

    def serves(call: routing.Call, variant: routing.Variant) -> bool:
        return python_rule(call, variant) and gpu.handler_choice(lib, call) == variant.name

    return serves


def _prepare(variant: routing.Variant, problem: problems.Problem) -> None:
    """Computes a problem's inputs, operands and reference."""
    case = cases.case(cases.ProblemClass.of(variant), problem)
    case.operands  # noqa: B018 - computed now, outside the GPU's timeout
    case.forward() if variant.kind == "fwd" else case.backward()


def _prepared(work, workers: int):
    """Yields (variant, its problems) of `work` in order, each once its problems are prepared
    (`_prepare`, on `workers` threads, up to `workers` variants ahead): the reference is ready
    before START, so that the parent's timeout measures the GPU's work."""
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        ahead = collections.deque()
        work = iter(work)
        while True:
            while len(ahead) < workers and (item := next(work, None)) is not None:
                variant, chosen = item
                ahead.append((item, [pool.submit(_prepare, variant, problem) for problem in chosen]))
            if not ahead:
                return
            item, futures = ahead.popleft()
            for future in futures:
                future.result()
            yield item


def _inconclusive_all(names, reason: str) -> None:
    for name in names:
        _say(START, name)
        _say(RESULT, Verdict(name, "inconclusive", reason).to_json())


def run(job: dict) -> int:
    names = job["variants"]
    try:
        device = gpu.Device(job["library"])
        info = device.open(job["device"])
    except (OSError, RuntimeError, gpu.CudaError) as error:
        # No device, exclusive compute mode, a library that does not match: not the kernels'.
        _say(DEVICE, json.dumps({"error": str(error)}))
        _inconclusive_all(names, f"the probe could not open the GPU: {error}")
        return 0
    _say(DEVICE, json.dumps(info))
    library = ffi.describe(job["library"])
    variants = ffi.manifest_variants(job["library"])
    serves = _serves(library, device.lib)
    settings = judge.Settings(info["sms"], library.dq_copies_max_keys, library.segments_backward_tile_m)
    _inconclusive_all([name for name in names if name not in variants],
                      f"{job['library']}'s manifest has no variant of that name")
    work = ((variants[name], problems.for_variant(variants[name], serves)) for name in names if name in variants)
    for variant, chosen in _prepared(work, min(MAX_WORKERS, os.cpu_count() or 1)):
        _say(START, variant.name)
        verdict = judge.judge(variant, chosen, device, settings)
        _say(RESULT, verdict.to_json())
        if verdict.verdict == "fault":
            # The context is lost: leave now, with no clean-up that could touch it (or wait for
            # the threads preparing later variants).
            os._exit(FAULT_STATUS)
    return 0


def main() -> int:
    return run(json.loads(sys.stdin.readline()))
