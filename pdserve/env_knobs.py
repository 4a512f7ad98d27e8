"""Settings read only from the environment: the one table of them (docs/options.md lists it, a test checks both).

Every flag of up / gateway / router / worker is also read from `PDSERVE_<FLAG>` (cli_args.py); the variables here are
the rest: machine-level engine switches an operator sets once per host, process plumbing `up` sets for its children,
and fault injection for tests. Each is read through `get` (or `enabled`) by its name, so that a variable nobody
declared cannot be read, and a reader cannot disagree with the table about its default.

Imports nothing but `os`: engine, kernels and services modules all read these.
"""
from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Knob:
    default: str  # "" : unset
    help: str
    kind: str     # engine | transfer | process | fault


KNOBS: dict[str, Knob] = {
    # engine: the fast path per machine (docs/engine.md, CPU kernels)
    "PDSERVE_CPU_ISA": Knob("", "cap the instruction set the engine uses: avx2, avx512, avx512_bf16 or amx (never "
                                "above what the CPU has)", "engine"),
    "PDSERVE_NATIVE_KERNELS": Knob("1", "0: never build or use the native CPU kernels (the torch path)", "engine"),
    "PDSERVE_KERNEL_BUILD_TIMEOUT": Knob("", "seconds a worker waits for the native kernels' one-time build before "
                                             "using the torch path (default: 300; `up` builds once first)", "engine"),
    "PDSERVE_DECODER_STACK": Knob("1", "0: always the Python layer loop instead of the fused decoder stack", "engine"),
    "PDSERVE_NATIVE_MOE": Knob("1", "0: sparse MoE layers always loop over their experts in Python instead of the "
                                    "native kernel for small steps", "engine"),
    "PDSERVE_GROUPED_MOE": Knob("1", "0: sparse MoE steps past the native kernel's size loop over their experts in "
                                     "Python instead of the grouped GEMMs", "engine"),
    "PDSERVE_BF16_WEIGHTS": Knob("", "1: dtype=auto keeps a bf16 checkpoint's projections in bf16; 0: never",
                                 "engine"),
    "PDSERVE_BATCH1_GEMV": Knob("", "1 / 0: force / forbid the plain weight copies for small-batch GEMVs", "engine"),
    "PDSERVE_FP32_PACK": Knob("", "1 / 0: force / forbid oneDNN-prepacked fp32 projections", "engine"),
    # KV transfer (docs/kv_transfer.md)
    "PDSERVE_KV_HUGEPAGES": Knob("1", "0: do not ask for transparent huge pages on the KV pool", "transfer"),
    "PDSERVE_KV_TP_STAGING": Knob("exact", "TP pulls: exact (stage only what moves non-contiguously), always or off",
                                  "transfer"),
    # processes
    "PDSERVE_LOG_LEVEL": Knob("INFO", "log level of every pdserve process", "process"),
    "PDSERVE_LOG_QUEUE_LINES": Knob("", "log lines queued for a slow sink before lines are dropped and counted "
                                        "(default: logs.QUEUE_LINES)", "process"),
    "PDSERVE_STATE_DIR": Knob("", "where `up` writes its state file and generated secrets (default: "
                                  "~/.cache/pdserve)", "process"),
    # fault injection: tests only, never set in a deployment
    "PDSERVE_FAULT_KV_PROTOCOL_VERSION": Knob("", "a worker announces this KV protocol version (another release)",
                                              "fault"),
    "PDSERVE_FAULT_STEP_DELAY_S": Knob("", "seconds added to every engine step", "fault"),
    "PDSERVE_FAULT_PULL_DELAY_S": Knob("", "seconds a decode worker waits before each KV pull", "fault"),
}

_FALSE = ("0", "false", "no", "off")


def get(name: str) -> str:
    """The variable's value, or the table's default when unset or empty."""
    return os.environ.get(name) or KNOBS[name].default


def enabled(name: str) -> bool:
    """An on/off knob: anything but 0 / false / no / off (and unset with default "1") is on."""
    return get(name).strip().lower() not in _FALSE + ("",)
