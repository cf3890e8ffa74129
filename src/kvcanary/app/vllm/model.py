"""A random-weight tiny Llama written locally with `transformers` (no model hub on this machine).

Shapes the CPU attention backend accepts (head_dim 64); `initializer_range=0.2` makes greedy
outputs depend on the input (with the default 0.02 every prompt yields the same token).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TinyLlamaSpec", "ensure_tiny_llama"]


@dataclass(frozen=True)
class TinyLlamaSpec:
    """The tiny model's shape and weight seed."""

    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2
    seed: int = 0

    @property
    def tag(self) -> str:
        """A directory name that changes whenever the spec does."""
        return "tiny-llama-" + "-".join(str(v) for v in asdict(self).values()).replace(".", "p")


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/kvcanary` (or `~/.cache/kvcanary`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvcanary"


def ensure_tiny_llama(spec: TinyLlamaSpec = TinyLlamaSpec(), root: Path | None = None) -> Path:
    """The model directory for `spec`, written on first use (about 10 MB)."""
    path = (root or default_cache_dir()) / spec.tag
    if (path / "config.json").exists() and (path / "kvcanary-spec.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    fields = {k: v for k, v in asdict(spec).items() if k != "seed"}
    model = LlamaForCausalLM(LlamaConfig(**fields))
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    model.save_pretrained(str(tmp))
    (tmp / "kvcanary-spec.json").write_text(json.dumps(asdict(spec)) + "\n")
    try:
        tmp.replace(path)
    except OSError:  # another process wrote the same spec first: keep theirs
        shutil.rmtree(tmp)
    return path
