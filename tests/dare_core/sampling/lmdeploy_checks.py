"""Checks against lmdeploy's own code on CPU, run by test_lmdeploy_cpu.py in a subprocess whose path
holds the CPU copy of lmdeploy (`make lmdeploy-cpu`): never imported by pytest itself.

lmdeploy's config builder, its model construction and its weight loader run on CPU; its attention
kernels do not, so what needs them is on the GPU (test_lmdeploy_engine.py's gpu tests)."""
from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import json
import sys
import tempfile
from pathlib import Path

import torch

import dare_core.models  # noqa: F401  (before tests/ joins the path: its dare_core folder is not the package)

REPO = Path(__file__).resolve().parents[3]
sys.path.append(str(REPO / "tests"))
REFERENCE = REPO.parent / "shared" / "reference" / "checkpoints"


def child_module():
    """The engine's child program, loaded the way its process runs it: by path, no package."""
    spec = importlib.util.spec_from_file_location("lmdeploy_child", REPO / "dare_core/sampling/engines/lmdeploy/child.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lmdeploy_config(view: Path):
    import lmdeploy.pytorch.config as lmd_config

    # bf16 is decided from the GPU's compute capability; this CPU stands in for a bf16 GPU
    lmd_config.is_bf16_supported = lambda *a, **k: True
    return lmd_config.ModelConfig.from_pretrained(str(view), trust_remote_code=False, dtype="auto")


def build_lmdeploy_model(config, device: str):
    from lmdeploy.pytorch.config import DLLMConfig
    from lmdeploy.pytorch.model_inputs import BuildModelContext
    from lmdeploy.pytorch.models.patch import build_patched_model

    return build_patched_model(config, device=device, build_model_ctx=BuildModelContext(dllm_config=DLLMConfig(block_length=4)))


def config_and_model(folders: list[str]) -> list[dict]:
    """For each checkpoint folder (config.json at least): lmdeploy's view of it, as the engine's
    process makes it read, against DARE's model of the same config."""
    from dare_core.models.lm import build_model
    from dare_core.sampling.engines.lmdeploy.folder import served_folder

    child_module().patch_mask_id()
    out = []
    for folder in map(Path, folders):
        ours = build_model(json.loads((folder / "config.json").read_text()), device="meta")
        with tempfile.TemporaryDirectory() as tmp:
            view = served_folder(folder, Path(tmp) / "view", ours.mask_token_id, ours.pad_token_id)
            config = lmdeploy_config(view)
            theirs = build_lmdeploy_model(config, "meta")
        rotary = theirs.model.rotary_emb
        out.append({"folder": folder.name, "mask": config.dllm_mask_token, "our_mask": ours.mask_token_id,
                    "paradigm": config.model_paradigm, "pad": config.hf_config.pad_token_id, "our_pad": ours.pad_token_id,
                    "rope_base": float(getattr(rotary, "base", getattr(getattr(rotary, "impl", None), "base", float("nan")))),
                    "our_rope": float(ours.config.rope_theta), "dtype": str(config.dtype),
                    "params": sum(p.numel() for p in theirs.parameters()), "our_params": sum(p.numel() for p in ours.parameters()),
                    "layers": config.num_layers, "our_layers": ours.config.n_layers})
    return out


def packed(name: str, ours: dict[str, torch.Tensor], n_experts: int) -> torch.Tensor:
    """What lmdeploy's parameter `name` must hold, from DARE's checkpoint-named tensors: its fused
    projections are the checkpoint's, concatenated in lmdeploy's order."""
    prefix = name.rsplit(".", 2)[0]
    if name.endswith("self_attn.qkv_proj.weight"):
        return torch.cat([ours[f"{prefix}.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")])
    if name.endswith("mlp.gate_up_proj.weight"):
        return torch.cat([ours[f"{prefix}.{p}.weight"] for p in ("gate_proj", "up_proj")])
    if name.endswith("mlp.experts.gate_up.weight"):
        return torch.stack([torch.cat([ours[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]) for e in range(n_experts)])
    if name.endswith("mlp.experts.down.weight"):
        return torch.stack([ours[f"{prefix}.{e}.down_proj.weight"] for e in range(n_experts)])
    return ours[name]


def weights(folders: list[str]) -> dict:
    """{folder: result} of `one_model_weights`, in one interpreter (lmdeploy's import costs seconds)."""
    return {folder: one_model_weights(folder) for folder in folders}


def one_model_weights(folder: str) -> dict:
    """DARE's checkpoint-named tensors of the folder's model loaded by lmdeploy's loader (the
    engine's `load_weights`) into lmdeploy's model on CPU: every parameter written, each equal to
    DARE's weights in lmdeploy's layout."""
    from lmdeploy.pytorch.weight_loader.model_weight_loader import ModelWeightLoader, process_weights_after_loading

    from dare_core.models.hf_folder import load_model

    child_module().patch_mask_id()
    ours = load_model(Path(folder), dtype=torch.float32, device="cpu")
    state = ours.hf_state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        from dare_core.sampling.engines.lmdeploy.folder import served_folder

        config = lmdeploy_config(served_folder(Path(folder), Path(tmp) / "view", ours.mask_token_id, ours.pad_token_id))
    config.dtype = torch.float32
    theirs = build_lmdeploy_model(config, "cpu")
    with torch.inference_mode():
        for p in theirs.parameters():
            p.fill_(float("nan"))
        theirs.load_weights(ModelWeightLoader._rename_weights_iterator(iter(state.items()), theirs))
        process_weights_after_loading(theirs)
    n_experts = json.loads((Path(folder) / "config.json").read_text()).get("num_experts", 0)
    unwritten = [n for n, p in theirs.named_parameters() if torch.isnan(p).any()]
    wrong = [n for n, p in theirs.named_parameters() if not torch.equal(p, packed(n, state, n_experts))]
    return {"params": len(list(theirs.parameters())), "unwritten": unwritten, "wrong": wrong}


def signatures() -> dict:
    """The lmdeploy names and arguments the engine's process calls exist as it calls them."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.messages import ResponseType
    from lmdeploy.pytorch.configurations.sdar import SDARModelConfigBuilder
    from lmdeploy.pytorch.engine import Engine
    from lmdeploy.pytorch.engine.engine_instance import EngineInstance
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent
    from lmdeploy.pytorch.model_inputs import ModelInputs
    from lmdeploy.pytorch.weight_loader.model_weight_loader import ModelWeightLoader, process_weights_after_loading

    from dare_core.sampling.engines.lmdeploy.engine import FIXED
    from dare_core.sampling.engines.lmdeploy.settings import map_params
    from dare_core.sampling.params import SamplingParams

    def params(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    # the engine's own settings and every dLLM setting map_params makes, as lmdeploy's config takes them
    engine_sets, requests = [], []
    for unmasking in ("topk", "threshold", "sequential"):
        p = SamplingParams(gen_length=16, steps=16, block_length=4, cache="block_kv", unmasking=unmasking, temperature=1.0,
                           remasking="maskgit_plus" if unmasking != "sequential" else "low_confidence", threshold=0.9)
        dllm, request = map_params(p, 4, 2)
        config = PytorchEngineConfig(**FIXED, cache_max_entry_count=0.5, max_batch_size=None, dtype="auto", session_len=64, **dllm)
        engine_sets.append({k: getattr(config, k) for k in dllm})
        requests.append(dataclasses.asdict(GenerationConfig(**request, random_seed=7))["random_seed"])
    agent_source = inspect.getsource(BaseModelAgent)
    return {
        "engine_sets": engine_sets, "request_seeds": requests,
        "from_pretrained": params(Engine.from_pretrained), "create_instance": hasattr(Engine, "create_instance"),
        "close": hasattr(Engine, "close"), "stream": params(EngineInstance.async_stream_infer), "end": params(EngineInstance.end),
        "response_types": [r.name for r in ResponseType], "model_inputs": [f.name for f in dataclasses.fields(ModelInputs)],
        "all_context": hasattr(BaseModelAgent, "all_context"), "forward": params(BaseModelAgent._async_model_forward),
        "patched_model": "self.patched_model.get_model()" in agent_source, "rename": params(ModelWeightLoader._rename_weights_iterator),
        "after_loading": params(process_weights_after_loading), "builder": params(SDARModelConfigBuilder.build),
    }


if __name__ == "__main__":
    result = globals()[sys.argv[1]](*json.loads(sys.argv[2]) if len(sys.argv) > 2 else [])
    print("RESULT " + json.dumps(result))
