"""GPU tests run the vLLM engine as production does: vLLM's default multiprocess mode, its
engine processes started fresh. This pytest process never touches CUDA (the trainer-side
logprobs that the tests compare against are computed on the CPU in float32), so vLLM may start
its processes either way and no test depends on the order the files run in."""
import pytest
import torch


def gpus() -> int:
    return torch.cuda.device_count()  # NVML-based: does not initialise CUDA in this process


def pytest_collection_modifyitems(config, items):
    for item in items:
        needs = item.get_closest_marker("gpus")
        count = needs.args[0] if needs else 1
        if gpus() < count:
            item.add_marker(pytest.mark.skip(reason=f"needs {count} CUDA GPU(s), found {gpus()}"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpus(n): needs n CUDA GPUs")
