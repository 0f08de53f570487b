"""Device dispatch: one `DevicePlan` holds every device decision and the reason for it.

`resolve(spec, precision)` detects the machine (`facts.detect`) and plans (`plan.plan_for`); tests call
`plan_for` with hand-made `DeviceFacts` to simulate CUDA, MPS and Graviton hosts.
"""

from core.device.facts import CpuFacts, CudaFacts, DeviceFacts, detect, detect_cpu
from core.device.plan import PRECISIONS, DevicePlan, applied_plan, available_devices, plan_for, resolve

__all__ = [
    "PRECISIONS",
    "CpuFacts",
    "CudaFacts",
    "DeviceFacts",
    "DevicePlan",
    "applied_plan",
    "available_devices",
    "detect",
    "detect_cpu",
    "plan_for",
    "resolve",
]
