import inspect
import os
import re

import pytest
import torch

from tests.tiny import tiny_target

# What in a test's source (its function, the module functions it calls, the fixtures it uses) marks it
# ``real_model`` (loads SmolLM2's weights) or ``subprocess`` (starts another process); `make test-fast` runs
# ``-m "not real_model and not subprocess"``, `make test` everything.
_REAL_MODEL = re.compile(r"""load_target\(\s*["']smollm2-135m["']|dspark\.load\(\s*["']smollm2-135m["']""")
_SUBPROCESS = re.compile(r"\bsubprocess\.|\bPopen\b|\btorchrun\b")
IN_CI = os.environ.get("CI", "").lower() == "true"


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _sources(item) -> list[str]:
    """The test function's source, those of the module-level functions it names and of its fixtures."""
    function = getattr(item, "function", None)
    if function is None:
        return []
    own = _source(function)
    module = inspect.getmodule(function)
    helpers = [_source(obj) for name, obj in vars(module).items()
               if inspect.isfunction(obj) and obj.__module__ == module.__name__ and re.search(rf"\b{name}\(", own)]
    info = getattr(item, "_fixtureinfo", None)
    fixtures = [_source(d.func) for defs in (info.name2fixturedefs.values() if info else ()) for d in defs]
    return [own, *helpers, *fixtures]


def pytest_collection_modifyitems(config, items):
    """Mark real-model and subprocess tests; tests marked ``cuda`` need a GPU: skipped without one
    (bench/gpu_check.sh runs them where one exists)."""
    skip_cuda = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        sources = _sources(item)
        if item.get_closest_marker("slow") or "smollm2" in getattr(item, "fixturenames", ()) \
                or any(_REAL_MODEL.search(s) for s in sources):
            item.add_marker(pytest.mark.real_model)
        if any(_SUBPROCESS.search(s) for s in sources):
            item.add_marker(pytest.mark.subprocess)
        if skip_cuda is not None and item.get_closest_marker("cuda") is not None:
            item.add_marker(skip_cuda)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (CI=true) a test that skips because SmolLM2 is unavailable fails instead: an install that cannot
    prepare the default target must not pass while checking nothing (tests/tiny.py fails such tests itself;
    this catches the skips written elsewhere)."""
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped and "SmolLM2" in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = f"CI=true: {report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr}"


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
