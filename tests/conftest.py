import pytest
import torch

from tests.tiny import tiny_target


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU: skipped without one (bench/gpu_check.sh runs them where one exists)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


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
