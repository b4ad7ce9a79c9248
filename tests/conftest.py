"""Shared fixtures (small configs, random fp16 K/V) and the rule on skips.

Tests skip only for what the repository cannot provide: a GPU, TensorRT (headers or runtime), an
optional package, a C++ compiler. The one in-repo exception is libpnmix_core, which a source
checkout may not have built yet: its tests skip with a reason that starts "libpnmix_core". Where
the library must exist (an installed pnmix, as in CI, always has pnmix/lib; PNMIX_REQUIRE_CORE=1 asks for it in a checkout),
such a skip fails the test instead, so a packaging regression cannot hide as skips.
"""

import os
from pathlib import Path

import pytest
import torch

from pnmix.config import PnMixConfig

# Without a GPU, Triton runs in its CPU interpreter, which must be chosen before triton is first
# imported (some test modules import it through transformers): choose it for the whole session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pnmix.testing import OTHER_CONFIG, make_random_kv  # OTHER_CONFIG: far from the manifest's

CORE_SKIP_PREFIX = "libpnmix_core"


def core_is_required() -> bool:
    import pnmix

    installed = (Path(pnmix.__file__).resolve().parent / "lib").is_dir()
    return os.environ.get("PNMIX_REQUIRE_CORE") == "1" or installed


def _fail_core_skip(report) -> None:
    """Turn a skip for a missing libpnmix_core into a failure where the library must exist."""
    if not report.skipped or not core_is_required():
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if reason.startswith("Skipped: "):
        reason = reason[len("Skipped: "):]
    if reason.startswith(CORE_SKIP_PREFIX):
        report.outcome = "failed"
        report.longrepr = f"libpnmix_core must be built here (PNMIX_REQUIRE_CORE=1 or an installed pnmix), but: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_core_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_core_skip(outcome.get_result())


@pytest.fixture(autouse=True, scope="session")
def small_bandwidth_probe():
    """The bench's bandwidth probe at its 256 MiB floor: on a machine with a large L3 its full size
    (4x the cache, up to 4 GiB) costs each bench test a second and gigabytes for a figure the
    tests only check for shape. test_the_bandwidth_probe_outgrows_the_last_level_cache tests the
    sizing."""
    from pnmix.bench import decode

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decode, "last_level_cache_bytes", lambda: None)
        yield


@pytest.fixture
def other_config() -> PnMixConfig:
    return PnMixConfig(**OTHER_CONFIG)


@pytest.fixture
def random_kv():
    """random_kv(batch, heads, n, dim, seed=0, scale=1.0, dtype=None) -> (k, v), fp16 unless told
    (pnmix.testing.make_random_kv, which module-level helpers import directly)."""
    return make_random_kv
