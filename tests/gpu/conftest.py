"""A one-rank NCCL process group for the CUDA tests."""

from __future__ import annotations

import datetime
import os

import pytest
import torch.distributed as dist


@pytest.fixture
def nccl_world_of_one():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()
