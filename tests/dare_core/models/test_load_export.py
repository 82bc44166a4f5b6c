"""Loading shard by shard onto the target device, from-scratch init in place, streamed export.

A saved model reloads to bit-identical logits (every family, float32 and bf16), a LoRA model's
merged export reloads to the merged model's logits, broken folders are named in the error, shards are
real safetensors files, a CPU from-scratch init gives the same tensors as the original host init, and
a failed export leaves nothing behind."""
import dataclasses
import json
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dare_core.config import load_config
from dare_core.diffusion.seeding import generator
from dare_core.errors import UserError
from dare_core.models import safetensors_io
from dare_core.models.family import get_family
from dare_core.models.hf_folder import ModelLoadError, inspect_model, load_model, save_model, verify_saved
from dare_core.models.lm import build_model, empty_model
from dare_core.models.lora import LoraSettings, apply_lora, lora_layers, merged_state_dict
from dare_core.models.tokenizer import char_tokenizer
from dare_core.training.checkpoint import META, convert_checkpoint
from dare_core.training.setup import initial_model
from tiny_models import EOS, FAMILIES, MASK, SMALL, VOCAB, tiny

REPO = Path(__file__).resolve().parents[3]


def _inputs():
    x = torch.randint(0, 60, (2, 12), generator=generator(1, "x"))
    attn = torch.ones_like(x)
    attn[1, :3] = 0
    return x, attn


def _tensors(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in list(model.named_parameters()) + list(model.named_buffers())}


def _assert_same_tensors(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].dtype == tb[name].dtype and torch.equal(ta[name], tb[name]), name


def _tuned_lora(model_type: str):
    model = tiny(model_type)
    apply_lora(model, LoraSettings(r=4, alpha=8))
    for layer in lora_layers(model.net):  # a trained adapter, so that the merge changes the weights
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1, generator=generator(2, "b"))
    return model.eval()


# ---- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reload_is_bit_identical(tmp_path, model_type, dtype):
    model = tiny(model_type).to(dtype)
    folder = save_model(model, tmp_path / "m", max_shard_bytes=30_000)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == str(dtype).removeprefix("torch.")
    reloaded = load_model(folder).eval()
    # every tensor, buffers too (the LLaDA2 expert bias), is read back and nothing stays on meta
    _assert_same_tensors(model, reloaded)
    x, attn = _inputs()
    assert torch.equal(model(x, attn), reloaded(x, attn))


def test_loading_a_folder_leaves_torch_dynamo_unimported(tmp_path):
    """Building on the meta device skips the modules' default inits: run there, they would import
    torch._dynamo (seconds of CPU in every eval, convert or inspect process). A fresh process, since
    this one may have imported it already."""
    folder = save_model(tiny("llada"), tmp_path / "m")
    probe = ("import sys\nfrom dare_core.models.hf_folder import inspect_model, load_model\n"
             f"inspect_model({str(folder)!r}); load_model({str(folder)!r})\nprint('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_load_casts_as_the_model_would(tmp_path, model_type):
    """Loading a float32 folder as bf16 (cast tensor by tensor as it is read) is the float32 model
    cast to bf16, bit for bit."""
    model = tiny(model_type)
    folder = save_model(model, tmp_path / "m", max_shard_bytes=30_000)
    bf = load_model(folder, dtype=torch.bfloat16).eval()
    _assert_same_tensors(model.to(torch.bfloat16), bf)
    x, attn = _inputs()
    assert torch.equal(model(x, attn), bf(x, attn))


def test_tied_embeddings_stay_tied(tmp_path):
    cfg = get_family("sdar").tiny_config(VOCAB, MASK, EOS, **SMALL["sdar"], tie_word_embeddings=True)
    model = build_model(cfg)
    model.net.init_weights(generator(0, "tied"), std=0.3)
    folder = save_model(model.eval(), tmp_path / "m")
    assert not any("lm_head" in k for k in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"])
    reloaded = load_model(folder)
    assert reloaded.net.lm_head.weight is reloaded.net.embed.weight
    empty = empty_model(cfg, dtype=torch.bfloat16)
    assert empty.net.lm_head.weight is empty.net.embed.weight and empty.net.embed.weight.dtype == torch.bfloat16
    x, attn = _inputs()
    assert torch.equal(model(x, attn), reloaded.eval()(x, attn))


def test_broken_folders_name_the_file_and_parameter(tmp_path):
    folder = save_model(tiny("llada"), tmp_path / "m", max_shard_bytes=20_000)
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2

    truncated = shards[1]
    data = truncated.read_bytes()
    truncated.write_bytes(data[: len(data) - 100])
    for read in (load_model, inspect_model):  # headers suffice: inspect_model reads no weight
        with pytest.raises(ModelLoadError, match=rf"{truncated.name}: not a readable safetensors file.*truncated"):
            read(folder)
    truncated.write_bytes(data)

    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, shard = next(iter(index["weight_map"].items()))
    other = next(s.name for s in shards if s.name != shard)
    # the index sends a tensor to a file that does not hold it
    index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], name: other}}))
    with pytest.raises(ModelLoadError, match=rf"{other}: lacks parameter '{name}'"):
        load_model(folder)
    # the checkpoint lacks a tensor altogether
    index_path.write_text(json.dumps({**index, "weight_map": {k: v for k, v in index["weight_map"].items() if k != name}}))
    with pytest.raises(ModelLoadError, match=rf"checkpoint lacks parameter '{name}'"):
        load_model(folder)


# ---- export --------------------------------------------------------------------------------------


def test_shards_are_real_safetensors_in_the_hf_layout(tmp_path):
    model = tiny("llada2_moe")
    limit = 20_000
    folder = save_model(model, tmp_path / "m", max_shard_bytes=limit)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(p.name for p in folder.glob("*.safetensors")) == shards
    expected = model.hf_state_dict()
    seen = {}
    for shard in shards:
        raw = (folder / shard).read_bytes()
        header_len = int.from_bytes(raw[:8], "little")
        assert (8 + header_len) % 8 == 0  # data 8-byte aligned, as safetensors writes it
        tensors = load_file(folder / shard)  # safetensors' own reader, not ours
        data_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert data_bytes <= limit or len(tensors) == 1
        assert len(raw) == 8 + header_len + data_bytes
        assert all(index["weight_map"][k] == shard for k in tensors)
        seen.update(tensors)
    assert seen.keys() == expected.keys()
    assert all(torch.equal(seen[k], expected[k]) and seen[k].dtype == expected[k].dtype for k in expected)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    # one shard by default, at these sizes
    single = save_model(model, tmp_path / "one")
    assert sorted(p.name for p in single.glob("*.safetensors")) == ["model-00001-of-00001.safetensors"]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_lora_export_reloads_to_the_merged_model(tmp_path, model_type):
    model = _tuned_lora(model_type)
    merged = build_model(model.hf_config)
    merged.net.load_state_dict(merged_state_dict(model), strict=True)
    merged.eval()
    folder = save_model(model, tmp_path / "m", max_shard_bytes=30_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert not any("lora" in k or "base_layer" in k for k in index["weight_map"])
    reloaded = load_model(folder).eval()
    _assert_same_tensors(merged, reloaded)
    x, attn = _inputs()
    assert torch.equal(merged(x, attn), reloaded(x, attn))
    assert not torch.equal(reloaded(x, attn), tiny(model_type)(x, attn))  # the adapter is in the weights
    verify_saved(model, folder)


def test_lora_merge_in_bf16_happens_in_the_weights_dtype(tmp_path):
    model = _tuned_lora("llada").to(torch.bfloat16)
    folder = save_model(model, tmp_path / "m")
    reloaded = load_model(folder).eval()
    assert all(p.dtype == torch.bfloat16 for p in reloaded.parameters())
    merged = build_model(model.hf_config, dtype=torch.bfloat16)
    merged.net.load_state_dict(merged_state_dict(model), strict=True)
    x, attn = _inputs()
    assert torch.equal(merged.eval()(x, attn), reloaded(x, attn))


def test_verify_saved_catches_a_changed_byte(tmp_path):
    model = tiny("Dream")
    folder = save_model(model, tmp_path / "m", max_shard_bytes=30_000)
    verify_saved(model, folder)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor
    shard.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=rf"{shard.name}: '.*' differs"):
        verify_saved(model, folder)


def _expect_untouched(tmp_path: Path, target: Path, before: dict) -> None:
    now = {p.name: p.read_bytes() for p in target.iterdir()} if target.exists() else None
    assert now == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["src"] + ([target.name] if before is not None else []))


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_export_leaves_nothing_behind(tmp_path, existing):
    """Failures midway (the file system refusing a shard's bytes; a file to copy that is missing,
    after every shard is written) leave the destination as it was and no temporary folder."""
    model = tiny("llada")
    (tmp_path / "src").mkdir()
    target = tmp_path / "out"
    before = None
    if existing:
        save_model(tiny("llada", seed=1), target)
        before = {p.name: p.read_bytes() for p in target.iterdir()}

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails (EFBIG) instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (15_000, hard))  # the first shard (~20 kB) is cut midway
    try:
        with pytest.raises(UserError, match="nothing was changed"):
            save_model(model, target, max_shard_bytes=20_000)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    _expect_untouched(tmp_path, target, before)

    with pytest.raises(UserError, match="nothing was changed"):
        save_model(model, target, max_shard_bytes=20_000, extra_files={"vocab.json": tmp_path / "src" / "missing.json"})
    _expect_untouched(tmp_path, target, before)


@pytest.mark.parametrize("lora", [False, True])
def test_convert_checkpoint_exports_and_verifies(tmp_path, lora):
    """A DeepSpeed-layout checkpoint (ZeRO <= 2) becomes a folder that reloads to the trained
    model's logits, LoRA merged."""
    model = _tuned_lora("sdar") if lora else tiny("sdar")
    tag = "step00000001"
    (tmp_path / "ckpt" / tag).mkdir(parents=True)
    torch.save({"module": model.state_dict()}, tmp_path / "ckpt" / tag / "mp_rank_00_model_states.pt")
    (tmp_path / "ckpt" / tag / META).write_text(json.dumps({"hf_config": model.hf_config, "zero_stage": 0,
                                                            "lora": dataclasses.asdict(model.lora) if lora else None}))
    (tmp_path / "ckpt" / "latest").write_text(tag)
    out = convert_checkpoint(tmp_path / "ckpt", tmp_path / "hf")
    reloaded = load_model(out).eval()
    merged = build_model(model.hf_config)
    merged.net.load_state_dict(merged_state_dict(model) if lora else model.net.state_dict(), strict=True)
    x, attn = _inputs()
    assert torch.equal(merged.eval()(x, attn), reloaded(x, attn))


# ---- from-scratch init ---------------------------------------------------------------------------


def _original_init(net, gen: torch.Generator, std: float = 0.02) -> None:
    """Transformer.init_weights as it was before weights could be drawn on the device: float32
    draws on the host, copied into each parameter. The reference the CPU init must keep."""
    for name, p in net.named_parameters():
        with torch.no_grad():
            if p.dim() == 1:
                p.copy_(torch.zeros_like(p) if name.endswith("bias") else torch.ones_like(p))
            else:
                scale = std / (2 * net.cfg.n_layers) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_init_of_the_embedded_default_is_unchanged(dtype):
    cfg = load_config(REPO / "params.yaml", ["run.seed=0", f"model.dtype={dtype}"])
    assert cfg.model.path is None and cfg.model.lora is None
    tok = char_tokenizer()
    new = initial_model(cfg, tok, torch.device("cpu"))
    # the original stage: a float32 CPU model, initialised on the host, then cast
    old = build_model(new.hf_config)
    _original_init(old.net, generator(0, "init"))
    old = old.to(getattr(torch, dtype))
    _assert_same_tensors(old, new)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_init_in_place_covers_every_tensor(model_type):
    """An empty model (garbage memory) initialised in place equals a default-built one initialised
    the same way: every parameter and buffer is set."""
    cfg = get_family(model_type).tiny_config(VOCAB, MASK, EOS, **SMALL[model_type])
    built = build_model(cfg)
    built.net.init_weights(generator(3, "init"))
    empty = empty_model(cfg)
    for t in list(empty.parameters()) + list(empty.buffers()):
        t.data.fill_(float("nan"))
    empty.net.init_weights(generator(3, "init"))
    _assert_same_tensors(built, empty)


# ---- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", FAMILIES)
def test_gpu_load_init_and_lora_export(tmp_path, monkeypatch, model_type):
    """Straight onto the GPU: a load equals the CPU load moved there; the device init is
    deterministic; a GPU LoRA model's merged export reloads to its merged weights."""
    # tensors span many chunks, so that the two pinned staging buffers are reused over and over
    monkeypatch.setattr(safetensors_io.StreamWriter, "CHUNK", 4096)
    folder = save_model(tiny(model_type), tmp_path / "m", max_shard_bytes=30_000)
    on_gpu = load_model(folder, dtype=torch.bfloat16, device="cuda")
    assert all(t.device.type == "cuda" for t in _tensors(on_gpu).values())
    _assert_same_tensors(load_model(folder, dtype=torch.bfloat16).to("cuda"), on_gpu)

    cfg = on_gpu.hf_config
    inits = []
    for _ in range(2):
        model = empty_model(cfg, device="cuda", dtype=torch.bfloat16)
        model.net.init_weights(generator(0, "init", device="cuda"))
        inits.append(model)
    _assert_same_tensors(*inits)

    apply_lora(on_gpu, LoraSettings(r=4, alpha=8))
    for layer in lora_layers(on_gpu.net):
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1, generator=generator(2, "b", device="cuda"))
    merged = {k: v.cpu() for k, v in on_gpu.hf_state_dict().items()}
    out = save_model(on_gpu, tmp_path / "merged", max_shard_bytes=30_000)
    verify_saved(on_gpu, out)
    reloaded = load_model(out).hf_state_dict()
    assert reloaded.keys() == merged.keys() and all(torch.equal(reloaded[k], merged[k]) for k in merged)


def test_stream_writer_counts_the_time_spent_waiting_for_a_slow_disk():
    import time

    from dare_core.models.safetensors_io import StreamWriter

    class SlowFile:
        def __init__(self):
            self.data = bytearray()

        def write(self, b):
            time.sleep(0.05)
            self.data += bytes(b)

    f = SlowFile()
    tensors = [torch.full((4,), i, dtype=torch.float32) for i in range(6)]
    with StreamWriter(f) as out:
        for t in tensors:
            out.write_tensor(t)
    assert bytes(f.data) == b"".join(t.numpy().tobytes() for t in tensors)
    # six 50 ms writes, at most two in flight: the caller stood waiting for most of them
    assert out.wait_s >= 0.2


def test_export_from_a_model_folder_copies_its_tokenizer_not_its_weights(tmp_path):
    """SFT from `model.path` exports with that folder as the tokenizer source: only its tokenizer files
    may come along. Copying the folder whole put the base model's shards, index and config over the
    merged export (the exported model was the base model) and copied 16 GB at the 8B shape."""
    base = save_model(tiny("llada"), tmp_path / "base", max_shard_bytes=30_000)
    (base / "tokenizer.json").write_text('{"stand-in": true}')
    (base / "tokenizer_config.json").write_text("{}")
    model = _tuned_lora("llada")
    merged = build_model(model.hf_config)
    merged.net.load_state_dict(merged_state_dict(model), strict=True)
    out = save_model(model, tmp_path / "out", max_shard_bytes=30_000, extra_files={"tokenizer": base})
    assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".safetensors")) == [
        ".dare-output", "config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_text() == '{"stand-in": true}'
    _assert_same_tensors(merged, load_model(out))
    verify_saved(model, out)
