"""Predictions: what a plan will cost on a device.

    devices    device profiles (registered by name, loaded from JSON), rates with units
    cost       the roofline cost model: a node's seconds on a profile
    simulator  the plan run on in-order compute / h2d / d2h engines: makespan, stalls, bounds

`predict` imports only `ir`."""
from einpage._exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "DEFAULT_DEVICE": "devices", "DeviceProfile": "devices", "PROFILES": "devices",
    "get_device": "devices", "load_device_file": "devices", "with_overrides": "devices",
    "task_seconds": "cost", "op_seconds": "cost",
    "Simulation": "simulator", "simulate": "simulator",
})
