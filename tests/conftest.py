import pytest
import torch

from tests.tiny import tiny_target


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tests run tiny models: a second OpenMP thread only adds overhead and contention on 2-core machines."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (converted once into $DSPARK_HOME)."""
    from dspark.target.model import load_target

    return load_target("smollm2-135m")


@pytest.fixture
def tiny():
    return tiny_target()
