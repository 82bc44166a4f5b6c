"""The CPU overlay of lmdeploy (`make lmdeploy-cpu`, tests/lmdeploy_cpu.py) is the locked release
and runs lmdeploy's PyTorch engine modules, SDAR's included, on DARE's own torch and transformers."""
from lmdeploy_cpu import lmdeploy_cpu, lock_pins, run_in_lmdeploy  # noqa: F401  (fixture)


def test_overlay_runs_the_locked_lmdeploy_on_dares_torch(lmdeploy_cpu):
    out = run_in_lmdeploy(lmdeploy_cpu, """
import sys
import lmdeploy, torch, transformers, triton
from lmdeploy.pytorch.engine import Engine
from lmdeploy.pytorch.models.sdar import SDARForCausalLM
assert not any('turbomind._turbomind' in m for m in sys.modules), 'the TurboMind binary was loaded'
print(lmdeploy.__version__, triton.__version__, torch.__version__, transformers.__version__)
""").stdout.splitlines()[-1].split()  # the last line: lmdeploy may log on import
    pins = lock_pins()
    assert out[:2] == [pins["lmdeploy"], pins["triton"]] and out[0] == "0.18.0", f"overlay: lmdeploy, triton {out[:2]}"
    import torch
    import transformers

    # DARE's own builds, not the engine environment's torch 2.12.1 / a second transformers
    assert out[2:] == [torch.__version__, transformers.__version__]
