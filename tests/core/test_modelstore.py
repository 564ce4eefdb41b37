from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tokenmill import modelstore
from tokenmill.modelstore import MARKER, model_name, resolve_model, sampling_defaults


@pytest.fixture
def fake_convert(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Replace the (slow, transformers-based) conversion; records each call's gguf."""
    calls: list[Path] = []

    def convert(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        time.sleep(0.2)  # long enough for a concurrent caller to pile up on the lock
        (out / "config.json").write_text(json.dumps({"source": gguf.read_text()}))

    monkeypatch.setattr(modelstore, "_convert_gguf", convert)
    return calls


def test_names() -> None:
    assert model_name("bundled:smollm2") == "SmolLM2-135M-Instruct"
    assert model_name("bundled:minilm") == "all-MiniLM-L6-v2"
    assert model_name("/models/llama-7b.Q4.gguf") == "llama-7b.Q4"
    assert model_name("/models/qwen2/") == "qwen2"


def test_bad_sources_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown bundled model"):
        resolve_model("bundled:gpt5", tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path / "empty"), tmp_path)
    (tmp_path / "weights.bin").write_text("x")
    with pytest.raises(ValueError, match="expected an HF directory"):
        resolve_model(str(tmp_path / "weights.bin"), tmp_path)


def test_hf_directory_is_used_in_place(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m"), tmp_path / "cache") == tmp_path / "m"
    assert resolve_model("bundled:minilm", tmp_path / "cache").joinpath("tokenizer.json").exists()


def test_gguf_converted_once_then_again_when_it_changes(tmp_path: Path, fake_convert: list[Path]) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_text("v1")
    cache = tmp_path / "cache"
    out = resolve_model(str(gguf), cache)
    assert out == cache / "tiny" and (out / MARKER).exists()
    assert resolve_model(str(gguf), cache) == out and len(fake_convert) == 1
    gguf.write_text("v2")
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    assert json.loads((resolve_model(str(gguf), cache) / "config.json").read_text()) == {"source": "v2"}
    assert len(fake_convert) == 2
    assert sorted(p.name for p in cache.iterdir()) == [".tiny.lock", "tiny"]  # no temp dirs left


def test_concurrent_resolves_convert_once(tmp_path: Path, fake_convert: list[Path]) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_text("v1")
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(str(gguf), tmp_path / "c")))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake_convert) == 1 and len(set(results)) == 1 and len(results) == 4


def test_failed_conversion_keeps_the_old_directory(
    tmp_path: Path, fake_convert: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    gguf = tmp_path / "tiny.gguf"
    gguf.write_text("v1")
    cache = tmp_path / "cache"
    good = resolve_model(str(gguf), cache)

    def broken(_gguf: Path, _out: Path) -> None:
        raise RuntimeError("disk full")

    monkeypatch.setattr(modelstore, "_convert_gguf", broken)
    os.utime(gguf, ns=(time.time_ns(), time.time_ns() + 10**9))
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(gguf), cache)
    assert (good / "config.json").exists()
    assert sorted(p.name for p in cache.iterdir()) == [".tiny.lock", "tiny"]


@pytest.mark.slow
def test_bundled_smollm2_converts_to_a_loadable_directory(model_cache: Path) -> None:
    out = resolve_model("bundled:smollm2", model_cache)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", MARKER):
        assert (out / name).exists(), name
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (576, 30, 3)
    assert "quantization_config" not in config
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())


def test_sampling_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "eos": 2})
    )
    assert sampling_defaults(str(tmp_path), tmp_path) == {"temperature": 0.6, "top_p": 0.95}
    assert sampling_defaults(str(tmp_path / "nothing"), tmp_path / "nothing") == {}
    # the bundled model's authors' recommendation wins over an empty generation config
    bundled = sampling_defaults("bundled:smollm2", tmp_path / "nothing")
    assert (bundled["temperature"], bundled["top_p"]) == (0.2, 0.9) and bundled["max_tokens"] > 0
