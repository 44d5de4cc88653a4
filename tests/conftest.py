import pytest

from tests.tiny import tiny_target


@pytest.fixture(scope="session")
def smollm2():
    """The real default target (converted once into $DSPARK_HOME)."""
    from dspark.target.model import load_target

    return load_target("smollm2-135m")


@pytest.fixture
def tiny():
    return tiny_target()
