"""bench/peer_d1.py's loader: a peer trainer's step methods are taken from its file as written,
without running the file's imports (d1's need trl, wandb and datasets), and bound to the state
they read. (The peer's own file is fetched for a bench run, never stored here: `--smoke` runs it.)"""
import sys

import pytest
import torch

from pipeline_helpers import REPO

sys.path.insert(0, str(REPO / "bench"))
import peer_d1  # noqa: E402

PEER = '''
import trl_that_is_not_installed
from wandb_neither import anything

class Other:
    def generate(self):
        return "wrong class"

class Trainer(Base):
    @profiling_decorator
    def compute_loss(self, x):
        return F.relu(torch.as_tensor(x)) * self.beta + np.float64(0)

    def generate(self, n):
        set_seed(0)
        return self.compute_loss(n) + torch.rand(())

    def unused(self):
        raise AssertionError
'''


def test_the_methods_are_the_files_own_and_its_imports_never_run(tmp_path):
    path = tmp_path / "trainer.py"
    path.write_text(PEER)
    methods = peer_d1.load_methods(path, "Trainer", ("compute_loss", "generate"))
    state = type("State", (), {"beta": 2.0, **methods})()  # (generate calls self.compute_loss)
    bound = {name: getattr(state, name) for name in methods}
    assert bound["compute_loss"](-1.0).item() == 0.0 and bound["compute_loss"](3.0).item() == 6.0
    first = bound["generate"](1.0)
    assert first == bound["generate"](1.0) and 2.0 <= first.item() < 3.0  # seeded by the peer's set_seed
    assert methods["generate"].__code__.co_filename == str(path)  # a traceback points into the peer's file
    with pytest.raises(ValueError, match="Trainer has no missing_one"):
        peer_d1.load_methods(path, "Trainer", ("generate", "missing_one"))
    with pytest.raises(ValueError, match="no class Absent"):
        peer_d1.load_methods(path, "Absent", ("generate",))


def test_hf_view_gives_logits_dtype_and_device():
    model = torch.nn.Embedding(10, 4)
    view = peer_d1.HFView(model)
    assert view.dtype == torch.float32 and view.device.type == "cpu"
    assert torch.equal(view(torch.tensor([[1, 2]])).logits, model(torch.tensor([[1, 2]])))
