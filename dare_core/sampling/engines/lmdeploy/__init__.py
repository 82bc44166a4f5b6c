"""The lmdeploy rollout engine (SDAR / block diffusion, CUDA only), in its own environment and
process (docs/sampling.md#engines, docs/environment.md#lmdeploy).

- `settings.py`: our sampler settings as lmdeploy's, refusing what it cannot honour exactly;
- `folder.py`: the view of a checkpoint folder that lmdeploy reads;
- `process.py`: the engine's process, calls to it and weights over CUDA IPC;
- `child.py`: the program that process runs, in lmdeploy's environment;
- `engine.py`: `LMDeployEngine`, the `RolloutEngine` registered as `lmdeploy`.
"""
from __future__ import annotations

from dare_core.sampling.engines.lmdeploy.engine import LMDeployEngine
from dare_core.sampling.engines.lmdeploy.folder import check_model, engine_config, served_folder
from dare_core.sampling.engines.lmdeploy.process import INSTALL_HINT, EngineProcess, engine_python, unavailable, weight_buckets
from dare_core.sampling.engines.lmdeploy.settings import (UNMASKING, assemble_output, map_params, request_seeds,
                                                          required_length, session_length)

__all__ = ["LMDeployEngine", "EngineProcess", "INSTALL_HINT", "UNMASKING", "assemble_output", "check_model", "engine_config",
           "engine_python", "map_params", "request_seeds", "required_length", "served_folder", "session_length",
           "unavailable", "weight_buckets"]
