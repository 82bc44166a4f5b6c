"""bench/peer_d1.py's loader: a peer trainer's step methods are taken from its file as written,
without running the file's imports (d1's need trl, wandb and datasets), and bound to the state
they read. (The peer's own file is fetched for a bench run, never stored here: `--smoke` runs it.)"""
import subprocess
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


def _git(cwd, *args) -> str:
    r = subprocess.run(["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com", "-C", str(cwd), *args],
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def test_the_commit_is_the_peer_checkouts_own_or_none(tmp_path):
    """A copied d1 folder inside this repository's ignored bench/.peers is no checkout of its own: git
    would name the enclosing repository's commit for its file, which is not d1's."""
    outer = tmp_path / "repo"
    peer = outer / "bench" / ".peers" / "d1"
    trainer = peer / "diffu-grpo" / "diffu_grpo_trainer.py"
    trainer.parent.mkdir(parents=True)
    trainer.write_text("class DiffuGRPOTrainer: pass\n")
    _git(outer, "init", "-q")
    (outer / "README").write_text("the enclosing repository\n")
    _git(outer, "add", "README")
    _git(outer, "commit", "-qm", "outer")
    assert peer_d1.source_commit(trainer, peer) is None
    _git(peer, "init", "-q")
    _git(peer, "add", ".")
    _git(peer, "commit", "-qm", "peer")
    assert peer_d1.source_commit(trainer, peer) == _git(peer, "rev-parse", "HEAD") != _git(outer, "rev-parse", "HEAD")
    assert peer_d1.source_commit(tmp_path / "absent" / "trainer.py", peer) is None  # no folder there at all
