"""LLaDA family: real weight names, save/load round trip, clear load errors, padding invariance."""
import json
import shutil

import pytest
import torch

from conftest import make_tiny_llada
from dare_core.models.hf_folder import ModelLoadError, load_model, save_model
from dare_core.models.lm import build_model
from reference_metadata import config as reference_config, index as reference_index


def test_llada_8b_parameter_names_match_the_real_index():
    config = reference_config("LLaDA-8B-Instruct")
    model = build_model(config, device="meta")
    shapes = model.hf_parameter_shapes()
    index = reference_index("LLaDA-8B-Instruct")
    assert set(shapes) == set(index["weight_map"])
    d, v, h = config["d_model"], config["embedding_size"], config["mlp_hidden_size"]
    assert shapes["model.transformer.wte.weight"] == (v, d)
    assert shapes["model.transformer.ff_out.weight"] == (v, d)
    assert shapes["model.transformer.blocks.0.ff_proj.weight"] == (h, d)
    assert shapes["model.transformer.blocks.0.ff_out.weight"] == (d, h)
    # bf16 bytes of every parameter = the index's total size
    assert 2 * sum(torch.Size(s).numel() for s in shapes.values()) == index["metadata"]["total_size"]


def test_round_trip_reproduces_logits_bit_for_bit(tmp_path, tiny_llada):
    save_model(tiny_llada, tmp_path / "m", max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert "model.safetensors.index.json" in files and sum(f.endswith(".safetensors") for f in files) > 1
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "llada" and cfg["architectures"] == ["LLaDAModelLM"] and "auto_map" in cfg
    reloaded = load_model(tmp_path / "m").eval()
    x = torch.randint(0, 38, (3, 17))
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    assert torch.equal(tiny_llada(x, mask), reloaded(x, mask))


def test_load_errors_name_file_and_parameter(tmp_path, tiny_llada):
    folder = save_model(tiny_llada, tmp_path / "m", max_shard_bytes=20_000)
    broken = tmp_path / "missing_shard"
    shutil.copytree(folder, broken)
    shard = sorted(broken.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(broken)

    wrong_type = tmp_path / "wrong_type"
    shutil.copytree(folder, wrong_type)
    cfg = json.loads((wrong_type / "config.json").read_text())
    (wrong_type / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt9"}))
    with pytest.raises(ModelLoadError, match="unknown model_type 'gpt9'"):
        load_model(wrong_type)

    wrong_shape = tmp_path / "wrong_shape"
    shutil.copytree(folder, wrong_shape)
    (wrong_shape / "config.json").write_text(json.dumps({**cfg, "mlp_hidden_size": 48}))
    with pytest.raises(ModelLoadError, match=r"model-\d+-of-\d+\.safetensors: parameter 'model\.transformer\.blocks\.0\.(ff_proj|ff_out|up_proj)\.weight' has shape"):
        load_model(wrong_shape)


def test_pad_and_mask_ids_must_differ():
    with pytest.raises(ModelLoadError, match="pad token id equals the mask token id"):
        make_tiny_llada(mask_id=38, eos_id=38)


def test_left_padding_never_influences_real_tokens(tiny_llada):
    """A left-padded row gives the same logits on its real tokens as the unpadded row alone."""
    x = torch.randint(0, 38, (1, 9))
    alone = tiny_llada(x)
    pad = torch.full((1, 4), 7)
    padded = torch.cat([pad, x], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 9, dtype=torch.long)], dim=1)
    out = tiny_llada(padded, mask)
    torch.testing.assert_close(out[:, 4:], alone, atol=1e-5, rtol=1e-5)
    # and changing the pad tokens changes nothing
    out2 = tiny_llada(torch.cat([pad + 3, x], dim=1), mask)
    torch.testing.assert_close(out2[:, 4:], out[:, 4:], atol=1e-6, rtol=0)


def test_attention_is_bidirectional(tiny_llada):
    x = torch.randint(0, 38, (1, 8))
    y = x.clone()
    y[0, -1] = (y[0, -1] + 1) % 38
    assert not torch.allclose(tiny_llada(x)[0, 0], tiny_llada(y)[0, 0])


def test_gradient_checkpointing_gives_same_gradients(tiny_llada):
    x = torch.randint(0, 38, (2, 10))
    tiny_llada.train()
    tiny_llada(x).logsumexp(-1).sum().backward()
    g1 = [p.grad.clone() for p in tiny_llada.parameters()]
    tiny_llada.zero_grad()
    tiny_llada.set_gradient_checkpointing(True)
    tiny_llada(x).logsumexp(-1).sum().backward()
    for a, p in zip(g1, tiny_llada.parameters()):
        torch.testing.assert_close(a, p.grad)
