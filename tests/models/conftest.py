import pytest
import torch


@pytest.fixture(autouse=True)
def _inference_on_one_thread():
    """Every test of the reference modules runs inference only, on one intra-op thread.

    The tensors are tiny: a second OpenMP thread only adds spin-waiting, which costs seconds
    when the 2 cores are shared with other jobs.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)
