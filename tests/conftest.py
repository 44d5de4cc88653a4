import inspect
import os
import re

import pytest
import torch

from tests.tiny import tiny_target

# The tiers. What in a test's source (its function, the module functions it calls, the fixtures it uses) marks
# it ``real_model`` (loads SmolLM2's weights), ``subprocess`` (starts another process) or ``statistical`` (a law
# of the whole decoding loop checked on thousands of decoded samples, tests/sampling/stats.py; the sampler's own
# laws are fast and stay in the fast tier); ``HEAVY`` names the other tests that take tens of seconds, and why. `make test-fast` leaves all four out, `make test` runs everything.
_REAL_MODEL = re.compile(r"""load_target\(\s*["']smollm2-135m["']|dspark\.load\(\s*["']smollm2-135m["']""")
_SUBPROCESS = re.compile(r"\bsubprocess\.|\bPopen\b|\btorchrun\b")
_STATISTICAL = re.compile(r"\b(?:goodness_of_fit|tv_bound|chi2_sf|_two_token_chi2)\(")
_DECODING_LOOP = re.compile(r"\b(?:SpeculativeGenerator|_?speculative_step)\(")
HEAVY = {  # node id or test file -> what makes it slow
    "tests/bench/test_speed.py": "times transformers' generate and our engine end to end",
    "tests/training/test_overfit_loop.py": "trains each drafter kind until it overfits, then decodes",
    "tests/modeling/test_compile_dtype.py::test_compiled_decoder_matches_eager_logits_and_greedy_output":
        "torch.compile (inductor)",
    "tests/data/test_label.py::test_offline_sources_give_disjoint_well_formed_records": "reads every offline source",
    "tests/serving/test_kv_admission.py::test_64_concurrent_2k_context_requests_are_admitted_or_queued":
        "prefills 64 prompts of 2,048 tokens",
}
IN_CI = os.environ.get("CI", "").lower() == "true"


def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _sources(item) -> list[str]:
    """The sources of the test function, of its fixtures and of the functions of its module that these call,
    directly or through one another."""
    function = getattr(item, "function", None)
    if function is None:
        return []
    module = inspect.getmodule(function)
    local = {name: _source(obj) for name, obj in vars(module).items()
             if inspect.isfunction(obj) and obj.__module__ == module.__name__}
    info = getattr(item, "_fixtureinfo", None)
    found = [_source(function)] + [_source(d.func) for defs in (info.name2fixturedefs.values() if info else ())
                                   for d in defs]
    seen: set[str] = set()
    todo = list(found)
    while todo:
        text = todo.pop()
        for name, source in local.items():
            if name not in seen and re.search(rf"\b{name}\(", text):
                seen.add(name)
                found.append(source)
                todo.append(source)
    return found


def pytest_collection_modifyitems(config, items):
    """Mark the tiers (above); tests marked ``cuda`` need a GPU: skipped without one
    (scripts/gpu_check.sh runs them where one exists)."""
    skip_cuda = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        sources = _sources(item)
        if item.get_closest_marker("slow") or "smollm2" in getattr(item, "fixturenames", ()) \
                or any(_REAL_MODEL.search(s) for s in sources):
            item.add_marker(pytest.mark.real_model)
        if any(_SUBPROCESS.search(s) for s in sources):
            item.add_marker(pytest.mark.subprocess)
        if any(_STATISTICAL.search(s) for s in sources) and any(_DECODING_LOOP.search(s) for s in sources):
            item.add_marker(pytest.mark.statistical)
        node = item.nodeid.split("[", 1)[0]
        if node in HEAVY or node.split("::", 1)[0] in HEAVY:
            item.add_marker(pytest.mark.heavy)
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
