"""The torch dtype of each dtype name the engine runs in (engine.config.DType). Configs, flags and KV
layouts carry the name, so that torch-free code can name a dtype; this is the one table from name
to torch dtype."""

from __future__ import annotations

from typing import get_args

import torch

from engine.config import DType

TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in get_args(DType)}
