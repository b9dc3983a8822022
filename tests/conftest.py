import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def nr_nc_reference(scores: torch.Tensor, n_iters: int) -> torch.Tensor:
    """Eq. (3) of the Sinkformers paper, literally: alternate NR and NC on K0 = exp(C) (float64)."""
    K = torch.exp(scores.double())
    for it in range(n_iters):
        K = K / K.sum(-1, keepdim=True) if it % 2 == 0 else K / K.sum(-2, keepdim=True)
    return K
