"""Where a job runs: world size, nodes and tensor-parallel degree, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmem_plugin.errors import ConfigError

__all__ = ["Layout"]


def _positive(name: str, value: Any, flag: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}. HINT: pass {flag} N with N >= 1")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A cluster layout: ``num_gpus`` ranks over ``num_nodes`` nodes, ``tp``-way
    tensor parallel inside a node, data parallel over the rest.

    Attributes:
        num_gpus: World size (all GPUs of all nodes).
        num_nodes: Nodes; every node holds ``num_gpus / num_nodes`` GPUs.
        tp: Tensor-parallel degree; the TP group stays inside one node
            (TP's per-layer collectives need the intra-node link).

    Raises:
        ConfigError: A degree that does not divide, or TP across nodes.
    """

    num_gpus: int = 1
    num_nodes: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        _positive("num_gpus", self.num_gpus, "--gpus")
        _positive("num_nodes", self.num_nodes, "--nodes")
        _positive("tp", self.tp, "--tp")
        if self.num_gpus % self.num_nodes:
            raise ConfigError(
                f"--gpus {self.num_gpus} is not a multiple of --nodes {self.num_nodes}: every node must hold "
                "the same number of GPUs. HINT: world size = nodes x GPUs per node"
            )
        if self.gpus_per_node % self.tp:
            raise ConfigError(
                f"--tp {self.tp} must divide the {self.gpus_per_node} GPUs of a node: a tensor-parallel group "
                f"stays inside one node. HINT: use a --tp that divides {self.gpus_per_node}"
            )

    @property
    def gpus_per_node(self) -> int:
        return self.num_gpus // self.num_nodes

    @property
    def dp(self) -> int:
        """Data-parallel degree (replicas or shards of the model states)."""
        return self.num_gpus // self.tp

    def check_model(self, config: Any) -> None:
        """The TP degree must divide what TP splits: attention heads, kv heads
        and the MLP's intermediate size.

        Raises:
            ConfigError: Names the dimension that ``tp`` does not divide.
        """
        if self.tp == 1:
            return
        dims = {
            "num_attention_heads": getattr(config, "num_attention_heads", None),
            "num_key_value_heads": getattr(config, "num_key_value_heads", None)
            or getattr(config, "num_attention_heads", None),
            "intermediate_size": getattr(config, "intermediate_size", None),
        }
        for name, value in dims.items():
            if value is not None and value % self.tp:
                raise ConfigError(
                    f"--tp {self.tp} does not divide the model's {name} ({value}). "
                    f"HINT: choose a --tp that divides {value}"
                )

    def to_dict(self) -> dict[str, int]:
        return {"num_gpus": self.num_gpus, "num_nodes": self.num_nodes, "tp": self.tp, "dp": self.dp}
