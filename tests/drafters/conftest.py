import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second OpenMP thread only adds contention on a shared 2-core machine (100x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
