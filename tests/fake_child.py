"""A stand-in for `python -m fa4_jax.runtime.probe` (tests/probe_stand_ins.py's FAKE_CHILD): reads the
job, prints the protocol's lines, and does to each variant what $FAKE_CHILD_PLAN (JSON: name ->
one of the words below) or else its name says:

    ..._hang_...          START, then never finishes
    ..._crash_...         START, then dies of SIGSEGV
    ..._fault_...         START, RESULT fault, exit status 3 (as the child does after a fault)
    ..._wrong_..., ..._inconclusive_..., ..._load-error_...   that verdict
    ..._stall_...         stops answering before START
    anything else         pass

Each start appends {"job": ..., "env": {JAX_PLATFORMS, CUDA_VISIBLE_DEVICES}} as a JSON line to
$FAKE_CHILD_LOG, if set; the DEVICE line names $FAKE_CHILD_GPU (default "NVIDIA B200").
"""
import json
import os
import signal
import sys
import time

from fa4_jax.runtime.probe.protocol import DEVICE, RESULT, START, Verdict


def say(line: str) -> None:
    print(line, flush=True)


def main() -> int:
    job = json.loads(sys.stdin.readline())
    if os.environ.get("FAKE_CHILD_LOG"):
        with open(os.environ["FAKE_CHILD_LOG"], "a") as log:
            env = {name: os.environ.get(name) for name in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")}
            log.write(json.dumps({"job": job, "env": env}) + "\n")
    say(DEVICE + json.dumps({"name": os.environ.get("FAKE_CHILD_GPU", "NVIDIA B200"), "sms": 148}))
    plan = json.loads(os.environ.get("FAKE_CHILD_PLAN", "{}"))
    for name in job["variants"]:
        does = plan.get(name) or next((word for word in ("stall", "hang", "crash", "wrong", "fault", "inconclusive",
                                                         "load-error") if f"_{word}_" in name), "pass")
        if does == "stall":
            time.sleep(3600)
        say(START + name)
        if does == "hang":
            time.sleep(3600)
        if does == "crash":
            os.kill(os.getpid(), signal.SIGSEGV)
        verdict = does
        say(RESULT + Verdict(name, verdict, None if verdict == "pass" else f"fake {verdict}", 0.01).to_json())
        if verdict == "fault":
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
