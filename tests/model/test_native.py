"""Building the native kernels: a kernel that does not compile is an error; no compiler is the torch path."""
import pytest

from zhuzi.model import native


@pytest.fixture
def fresh_load():
    native.load.cache_clear()
    yield native.load
    native.load.cache_clear()


def test_a_kernel_that_does_not_compile_raises(fresh_load, monkeypatch):
    monkeypatch.setenv("CXX", "false")  # a compiler that fails every build
    with pytest.raises(native.KernelBuildError, match="small_m_linear.cpp does not compile with false"):
        fresh_load("small_m_linear")


def test_without_a_compiler_the_torch_path_runs(fresh_load, monkeypatch):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")
    assert native.compiler() is None
    assert fresh_load("small_m_linear") is None
