"""titan_spec: online EAGLE-3 draft co-training during RL post-training, on torchtitan."""

import logging as _logging

from titan_spec import platform as _platform

# torchao 0.18 registers Enums with torch's pytree, which torch 2.14 supports natively;
# the resulting deprecation warning prints on every import and is not ours to act on.
_logging.getLogger("torch.utils._pytree").setLevel(_logging.ERROR)

# torchtitan reads the device type when first imported; the CPU shims must come first.
_platform.apply_cpu_shims()

__version__ = "0.1.0"
