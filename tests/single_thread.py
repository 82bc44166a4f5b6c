"""An autouse fixture for test modules of tiny models: one intra-op thread while each test runs
(restored afterwards). Threads only add synchronisation on such small tensors, and on a machine
shared with other jobs their spin-waiting makes the tests many times slower. Use it with
`from single_thread import one_intra_op_thread  # noqa: F401`."""
import pytest
import torch


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
