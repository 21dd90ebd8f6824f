"""``lightning-pipe-export``: a sharded checkpoint directory becomes one Lightning file, or a
transformers folder (``model.safetensors`` + ``config.json``) that ``from_pretrained`` loads, with the
outputs of the model that was saved.

The directories here are written in this process through the strategy's own sharded writer (DCP without
a process group): tiny transformers models do not run in a pipeline on this branch yet, and the
pipelined writers are tested in tests/strategies/test_distributed_checkpoints.py, whose consolidated
checkpoints equal one device's.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_pipe.export import consolidate_checkpoint, export_safetensors, main
from lightning_pipe.strategies.distributed_checkpoint import ShardedCheckpoints, local_module_state

transformers = pytest.importorskip("transformers")


class HFLM(L.LightningModule):
    """A LightningModule holding a transformers causal LM under ``self.model``."""

    def __init__(self, kind: str = "llama") -> None:
        super().__init__()
        if kind == "llama":
            config = transformers.LlamaConfig(
                vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
            )
            self.model = transformers.LlamaForCausalLM(config)
        else:  # GPT-2 ties its head to the token embedding
            config = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=32)
            self.model = transformers.GPT2LMHeadModel(config)
        self.save_hyperparameters({"config": config.to_dict()})

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def _save_sharded(module: L.LightningModule, path) -> None:
    checkpoint = {
        "state_dict": local_module_state(module),
        "hyper_parameters": dict(module.hparams),
        "pipeline": {"state_dict_keys": list(module.state_dict())},
    }
    ShardedCheckpoints().save(checkpoint, path)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_safetensors_export_loads_into_the_plain_transformers_model(tmp_path, kind):
    torch.manual_seed(0)
    module = HFLM(kind).eval()
    with torch.no_grad():  # move away from the initialization, which from_pretrained could reproduce
        for p in module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    _save_sharded(module, tmp_path / "sharded.ckpt")
    main([str(tmp_path / "sharded.ckpt"), str(tmp_path / "hf"), "--format", "safetensors"])
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, module.model(ids).logits, atol=0, rtol=0)


def test_consolidated_export_is_the_module_state_dict(tmp_path):
    torch.manual_seed(0)
    module = HFLM("gpt2").eval()
    _save_sharded(module, tmp_path / "sharded.ckpt")
    main([str(tmp_path / "sharded.ckpt"), str(tmp_path / "one.ckpt")])
    checkpoint = torch.load(tmp_path / "one.ckpt", weights_only=False)
    assert list(checkpoint["state_dict"]) == list(module.state_dict())  # the module's key order
    plain = HFLM("gpt2")
    plain.load_state_dict(checkpoint["state_dict"])
    for name, value in module.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[name], value, atol=0, rtol=0)


def test_export_refuses_what_it_cannot_do(tmp_path):
    with pytest.raises(ValueError, match="not a sharded checkpoint directory"):
        consolidate_checkpoint(tmp_path)
    state = {"state_dict": {"model.a": torch.zeros(1), "head.b": torch.zeros(1)}}
    with pytest.raises(ValueError, match="several attributes.*--prefix"):
        export_safetensors(state, tmp_path / "out")
    with pytest.raises(ValueError, match="No key of the checkpoint starts with 'encoder.'"):
        export_safetensors(state, tmp_path / "out", prefix="encoder")
