"""Suite-wide settings: one intra-op thread per test process.

`make test` runs two pytest workers on two cores; PyTorch's default of one thread
per core would oversubscribe them and make tiny steps many times slower.
"""

from __future__ import annotations

import torch

torch.set_num_threads(1)
