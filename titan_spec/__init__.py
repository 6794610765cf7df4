"""titan_spec: online EAGLE-3 draft co-training during RL post-training, on torchtitan."""

from titan_spec import platform as _platform

# torchtitan reads the device type when first imported; the CPU shims must come first.
_platform.apply_cpu_shims()

__version__ = "0.1.0"
