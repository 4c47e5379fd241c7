"""mlxd.models: the memory budget's source as a table, and the child
process that asks the GPU on the gateway's behalf."""

import json
import pytest

from mlxd.models import (CUDA_SOURCE, METAL_SOURCE, TOTAL_ENV, device_memory, device_memory_in_child,
                         device_memory_of, system_memory_budget)

GIB = 1024**3


@pytest.mark.parametrize("env_total, device, expected", [
    (str(64 * GIB), (48 * GIB, METAL_SOURCE), (48 * GIB, TOTAL_ENV)),  # the override wins
    (None, (48 * GIB, METAL_SOURCE), (36 * GIB, METAL_SOURCE)),
    (None, (80 * GIB, CUDA_SOURCE), (60 * GIB, CUDA_SOURCE)),  # the card's memory, not the host's RAM
    (None, None, (None, "physical memory")),  # the CPU backend: psutil's total
])
def test_where_the_budget_comes_from(monkeypatch, env_total, device, expected):
    if env_total is None:
        monkeypatch.delenv(TOTAL_ENV, raising=False)
    else:
        monkeypatch.setenv(TOTAL_ENV, env_total)
    budget, source = system_memory_budget(0.75, lambda: device)
    assert source == expected[1]
    if expected[0] is not None:
        assert budget == expected[0]
    else:
        import psutil

        assert budget == int(psutil.virtual_memory().total * 0.75)


# mx.device_info()'s keys: Metal's (mlx.core.metal docs); CUDA's as an H100 answered (MLX 0.32.4, mlx-cuda-13).
METAL_INFO = {"architecture": "applegpu_g15s", "memory_size": 64 * GIB, "max_recommended_working_set_size": 48 * GIB}
CUDA_INFO = {"device_name": "NVIDIA H100 80GB HBM3", "total_memory": 85_520_809_984, "free_memory": 84_465_090_560,
             "architecture": "sm_90"}


@pytest.mark.parametrize("metal, cuda, info, expected", [
    (True, False, METAL_INFO, (48 * GIB, METAL_SOURCE)),  # the working set, not all of the unified memory
    (False, True, CUDA_INFO, (85_520_809_984, CUDA_SOURCE)),
    (False, True, {"memory_size": 80 * GIB}, (80 * GIB, CUDA_SOURCE)),  # the other name for it
    (False, True, {"device_name": "x"}, None),  # no size: physical memory decides
    (False, False, {}, None),  # the CPU backend
])
def test_the_gpus_memory(metal, cuda, info, expected):
    assert device_memory_of(metal, cuda, info) == expected


def test_the_child_process_sees_what_this_process_sees(caplog):
    # "darwin" forces the child even here, so its code path runs everywhere.
    assert device_memory_in_child("darwin") == device_memory()
    assert "could not ask" not in caplog.text


def weights_folder(d, size: int) -> str:
    """A folder whose model.safetensors holds `size` bytes of weights."""
    d.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [size // 4], "data_offsets": [0, size]}}).encode()
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(size))
    return str(d)


def test_the_largest_embedding_model_on_disk_is_counted_beside_every_chat_model(tmp_path):
    """At most one encoder is resident beside the chat model: the largest's weights are in each estimate."""
    from mlxd.config import parse_config
    from mlxd.models import largest_encoder, model_info

    def folder(name: str, size: int) -> str:
        return weights_folder(tmp_path / name, size)

    chat = folder("chat", 1 << 20)
    (tmp_path / "chat" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                             "num_hidden_layers": 2, "num_attention_heads": 4}))
    base = {"models": {"chat": {"path": chat}}, "embeddings": {}}
    alone = model_info(parse_config(base, tmp_path), "chat", 2**40).footprint
    assert alone.weights_bytes == 1 << 20
    config = parse_config({**base, "embeddings": {"small": {"path": folder("small", 4096)},
                                                  "large": {"path": folder("large", 8192)},
                                                  "gone": {"path": str(tmp_path / "missing")}}}, tmp_path)
    assert largest_encoder(config) == ("large", 8192)
    beside = model_info(config, "chat", 2**40).footprint
    assert beside.weights_bytes == alone.weights_bytes + 8192 and "embedding model large" in beside.source
    assert largest_encoder(parse_config(base, tmp_path)) is None


def test_a_cross_encoder_reranker_is_counted_beside_the_embedding_model(tmp_path):
    """A cross-encoder stays resident beside the chat and embedding models: the largest's weights count too;
    a reranker of embeddings or of a chat model holds none of its own."""
    from mlxd.config import parse_config
    from mlxd.models import largest_cross_encoder, model_info

    def folder(name: str, size: int) -> str:
        return weights_folder(tmp_path / name, size)

    chat = folder("chat", 1 << 20)
    (tmp_path / "chat" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
                                                             "num_hidden_layers": 2, "num_attention_heads": 4}))
    base = {"models": {"chat": {"path": chat}}, "embeddings": {"enc": {"path": folder("enc", 4096)}}}
    no_cross = parse_config({**base, "rerankers": {"cos": {"embedding": "enc"}, "judge": {"chat_model": "chat"}}},
                            tmp_path)
    assert largest_cross_encoder(no_cross) is None
    alone = model_info(no_cross, "chat", 2**40).footprint
    assert alone.weights_bytes == (1 << 20) + 4096
    config = parse_config({**base, "rerankers": {"ce": {"path": folder("ce", 16384)}, "cos": {"embedding": "enc"}}},
                          tmp_path)
    assert largest_cross_encoder(config) == ("ce", 16384)
    beside = model_info(config, "chat", 2**40).footprint
    assert beside.weights_bytes == alone.weights_bytes + 16384 and "reranker ce" in beside.source
