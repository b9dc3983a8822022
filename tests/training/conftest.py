import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors on a shared 2-core machine: one intra-op thread is faster and deterministic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
